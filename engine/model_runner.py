"""Turns a scheduled step into tensors, runs the model, and samples the rows that need it."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from engine.attention.base import AttentionBackend
from engine.grammar import GrammarMasks
from engine.logits_processors import process_logits
from engine.models.llama import LlamaModel
from engine.sampler import SamplingRows, sample, token_logprobs
from engine.scheduler import ScheduledChunk
from shared.protocol import TokenLogprobs


class SampledToken(msgspec.Struct):
    token: int
    logprob: float | None = None  # the chosen token's, when the request wants logprobs
    logprobs: TokenLogprobs | None = None


class PromptLogprobs(msgspec.Struct):
    """Logprobs of prompt positions start+1 .. start+len(chosen) (the tokens after each fed
    position), from one prefill chunk."""

    start: int
    chosen: np.ndarray  # float32[k]
    top_ids: np.ndarray  # int32[k, n]
    top_logprobs: np.ndarray  # float32[k, n]


class StepResult(msgspec.Struct):
    sampled: list[SampledToken]  # one per chunk whose `samples` is True, in order
    prompt_logprobs: dict[str, PromptLogprobs]  # by request id


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        vocab_size: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.vocab_size = vocab_size
        self.device = model.device

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        input_ids, positions, sample_rows = self._flatten(chunks)
        meta = self.backend.prepare(chunks)
        hidden = self.model.forward(input_ids, positions, self.backend, meta)
        seqs = [c.seq for c in chunks if c.samples]
        # On the CPU while the device still runs the forward pass.
        masks = _grammar_masks(seqs)
        result = StepResult([], self._prompt_logprobs(chunks, hidden))
        if seqs:
            logits = self.model.logits(hidden[sample_rows])
            result.sampled = self._sample(seqs, logits, masks)
        return result

    def _sample(self, seqs, logits: torch.Tensor, masks: GrammarMasks | None = None
                ) -> list[SampledToken]:
        process_logits(logits, seqs)
        if masks is not None:
            # Last, so nothing re-enables a token the grammar forbids; logprobs see it (O-4).
            seqs[masks.rows[0]].grammar.backend.apply_masks(logits, masks)
        params = [s.params for s in seqs]
        rows = SamplingRows.build(params, [s.generator for s in seqs], self.vocab_size)
        tokens = sample(logits, rows)
        sampled = [SampledToken(t) for t in tokens.tolist()]
        wanting = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanting:
            num_top = max(params[i].logprobs for i in wanting)
            chosen, top_ids, top_lps = token_logprobs(logits[wanting], tokens[wanting], num_top)
            for r, i in enumerate(wanting):
                n = params[i].logprobs
                sampled[i].logprob = float(chosen[r])
                sampled[i].logprobs = TokenLogprobs(
                    chosen[r : r + 1].cpu().numpy().astype("<f4").tobytes(),
                    top_ids[r, :n].cpu().numpy().astype("<i4").tobytes(),
                    top_lps[r, :n].cpu().numpy().astype("<f4").tobytes(),
                )
        return sampled

    def _prompt_logprobs(self, chunks, hidden: torch.Tensor) -> dict[str, PromptLogprobs]:
        out, row = {}, 0
        for chunk in chunks:
            seq, rows = chunk.seq, slice(row, row + chunk.num_tokens)
            row += chunk.num_tokens
            n = seq.params.prompt_logprobs
            # Each fed prompt position predicts the next prompt token, if there is one.
            last = min(chunk.start + chunk.num_tokens, seq.num_prompt_tokens - 1)
            if n is None or seq.num_output_tokens > 0 or last <= chunk.start:
                continue
            count = last - chunk.start
            logits = self.model.logits(hidden[rows][:count])
            targets = torch.tensor(seq.token_ids[chunk.start + 1 : last + 1], device=self.device)
            chosen, top_ids, top_lps = (t.cpu().numpy() for t in token_logprobs(logits, targets, n))
            out[seq.request_id] = PromptLogprobs(
                chunk.start, chosen, top_ids.astype(np.int32), top_lps
            )
        return out

    def _flatten(self, chunks: list[ScheduledChunk]):
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            ids.extend(chunk.seq.token_ids[chunk.start : end])
            positions.extend(range(chunk.start, end))
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(positions), as_tensor(sample_rows)


def _grammar_masks(seqs) -> GrammarMasks | None:
    grammars = [s.grammar for s in seqs]
    first = next((g for g in grammars if g is not None), None)
    return None if first is None else first.backend.fill_masks(grammars)
