"""Per-request changes to a step's logits before sampling, as tensor ops over the batch.

Order (as vLLM): allowed_token_ids and bad_words (masks), logit_bias, the min_tokens mask
on stop tokens, repetition, frequency and presence penalties, then the thinking budget.
Rows that use none of these cost nothing: each stage builds tensors only for the rows that
need it.
"""

from __future__ import annotations

import torch

from engine.request.sequence import Sequence
from engine.request.thinking import ThinkingTracker


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place; row i of `logits` belongs to seqs[i]."""
    _allowed_tokens(logits, seqs)
    _bad_words(logits, seqs)
    _logit_bias(logits, seqs)
    _min_tokens(logits, seqs)
    _penalties(logits, seqs)
    _thinking_budget(logits, seqs)


def _thinking_budget(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Past its thinking budget a row can only write the end tag's next token (last, so no
    other stage brings another token back)."""
    for i, seq in enumerate(seqs):
        spec = seq.params.thinking
        if spec is None:
            continue
        if seq.thinking is None:
            seq.thinking = ThinkingTracker(spec)
        seq.thinking.observe(seq.token_ids, seq.num_prompt_tokens)
        token = seq.thinking.forced()
        if token is not None:
            logits[i].fill_(float("-inf"))
            logits[i, token] = 0.0


def _allowed_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Rows with allowed_token_ids keep only those; every other token becomes -inf."""
    for i, seq in enumerate(seqs):
        allowed = seq.params.allowed_token_ids
        if allowed:
            keep = torch.tensor(allowed, device=logits.device)
            row = torch.full_like(logits[i], float("-inf"))
            row[keep] = logits[i, keep]
            logits[i] = row


def _bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """A bad word's last token is banned where the output ends with the rest of it."""
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        if not seq.params.bad_words:
            continue
        tokens, generated = seq.token_ids, seq.num_output_tokens  # no copy of the output
        for ids in seq.params.bad_words:
            prefix = len(ids) - 1
            if prefix == 0 or (generated >= prefix and tokens[-prefix:] == ids[:-1]):
                rows.append(i)
                cols.append(ids[-1])
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def _logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    rows, cols, values = [], [], []
    for i, seq in enumerate(seqs):
        for token_id, bias in seq.params.logit_bias:
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    if rows:
        device = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(values, device=device), accumulate=True,
        )


def _min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Until min_tokens are out, EOS and stop token ids cannot be drawn."""
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        if seq.num_output_tokens >= seq.params.min_tokens:
            continue
        rows.extend([i] * len(seq.min_tokens_banned))
        cols.extend(seq.min_tokens_banned)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def _penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    vocab = logits.shape[1]
    repetition = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    if repetition:
        # Counts prompt and output tokens (req P-11).
        seen = (_counts([seqs[i].token_ids for i in repetition], vocab) > 0).to(logits.device)
        penalty = torch.tensor(
            [seqs[i].params.repetition_penalty for i in repetition], device=logits.device
        )
        rows = logits[repetition]
        scaled = torch.where(rows > 0, rows / penalty[:, None], rows * penalty[:, None])
        logits[repetition] = torch.where(seen, scaled, rows)
    additive = [
        i for i, s in enumerate(seqs)
        if s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0
    ]
    if additive:
        # Counts output tokens only (req P-11).
        counts = _counts([seqs[i].output_ids for i in additive], vocab).to(logits.device)
        frequency = torch.tensor(
            [seqs[i].params.frequency_penalty for i in additive], device=logits.device
        )
        presence = torch.tensor(
            [seqs[i].params.presence_penalty for i in additive], device=logits.device
        )
        logits[additive] -= frequency[:, None] * counts + presence[:, None] * (counts > 0)


def _counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """[R, vocab] float32 occurrence counts, via one scatter_add over padded ids."""
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for r, tokens in enumerate(token_lists):
        if tokens:
            ids[r, : len(tokens)] = torch.tensor(tokens)
    counts = torch.zeros((len(token_lists), vocab + 1))
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]
