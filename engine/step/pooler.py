"""Pooling a prefill's hidden states into one vector per request (vLLM's --runner pooling).

A pooling request runs as one prefill chunk (the scheduler never splits it), so its chunk's
rows of the step's final hidden states are the whole prompt: CLS takes the first, LAST the
last, MEAN averages them. Then, in float32: Matryoshka truncation to the request's
`dimensions`, and normalization (after the cut, so the short vector has unit length too).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.request.batch import ScheduledChunk
from shared.protocol import PoolingParams
from shared.runner_config import PoolerConfig


def pool_chunks(hidden: torch.Tensor, chunks: list[ScheduledChunk], pooler: PoolerConfig,
                classify=None) -> dict[str, np.ndarray]:
    """By request id: the pooled float32 vector of every pooling chunk in the step.
    `hidden`: the final (normed) hidden states of every fed row, chunks in order.
    `classify`: a cross-encoder's head (pooled rows -> logits); its requests get
    probabilities instead (`scores`)."""
    out: dict[str, np.ndarray] = {}
    row = 0
    for chunk in chunks:
        rows = hidden[row : row + chunk.num_tokens]
        row += chunk.num_tokens
        params = chunk.seq.pooling
        if params is None:
            continue
        pooled = pool_rows(rows, pooler.pooling_type)
        if classify is not None:
            out[chunk.seq.request_id] = scores(classify(pooled[None].to(hidden.dtype))[0])
        else:
            out[chunk.seq.request_id] = finish_vector(pooled, params, pooler)
    return out


class TokenScoreHead:
    """A decoder served as a yes/no reranker (vLLM's `is_original_qwen3_reranker`): its one
    label's logit is logit(true token) - logit(false token) at the pooled (last) row, from
    the LM head's two rows; so the score's sigmoid equals P(true) of a softmax over the two.
    `difference`: row(true) - row(false) in float32 (engine.process.build puts it together from the
    ranks' parts of the LM head under tensor parallelism)."""

    def __init__(self, difference: torch.Tensor, device) -> None:
        self.weight = difference.to(torch.float32)[None].to(device)

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        return pooled.to(torch.float32) @ self.weight.T


def scores(logits: torch.Tensor) -> np.ndarray:
    """vLLM's, for score and classify alike: the sigmoid of a one-label head (a softmax over
    one logit is always 1); else the softmax over the labels."""
    logits = logits.to(torch.float32)
    probs = torch.sigmoid(logits) if len(logits) < 2 else logits.softmax(-1)
    return probs.cpu().numpy().astype(np.float32)


def pool_rows(rows: torch.Tensor, pooling_type: str) -> torch.Tensor:
    rows = rows.to(torch.float32)
    if pooling_type == "CLS":
        return rows[0]
    if pooling_type == "MEAN":
        return rows.mean(dim=0)
    return rows[-1]


def finish_vector(vector: torch.Tensor, params: PoolingParams, pooler: PoolerConfig
                  ) -> np.ndarray:
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    normalize = pooler.normalize if params.normalize is None else params.normalize
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector.cpu().numpy().astype(np.float32)
