"""Turns a scheduled step into tensors, runs the model, and samples the rows that need it."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.models.llama import LlamaModel
from engine.sampler import SamplingRows, sample
from engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, vocab_size: int) -> None:
        self.model = model
        self.backend = backend
        self.vocab_size = vocab_size
        self.device = model.device

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Run one step; returns one new token for each chunk whose `samples` is True."""
        input_ids, positions, sample_rows = self._flatten(chunks)
        meta = self.backend.prepare(chunks)
        hidden = self.model.forward(input_ids, positions, self.backend, meta)
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return []
        logits = self.model.logits(hidden[sample_rows])
        rows = SamplingRows.build(
            [c.seq.params for c in sampling], [c.seq.generator for c in sampling], self.vocab_size
        )
        return sample(logits, rows).tolist()

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
