"""The attention-backend interface the models are written against.

A backend owns the KV cache tensors (their layout is its business) and, once per step, turns
the scheduled chunks into whatever metadata its kernels want. Models call `attend` once per
layer with the step's new q/k/v; the backend stores k/v in the cache and attends over each
sequence's whole context.

Contract: all of a step's new k/v are stored before any of its attention reads the cache. The
scheduler relies on it to let a sequence read prefix pages another sequence of the same step
is filling (prompt sharing for n > 1).

A model with latent attention (DeepSeek's MLA) calls `attend_latent` instead, on the
backend built for it (engine.attention.mla_backend): one latent row per token, not K/V.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.request.batch import ScheduledChunk


class AttentionBackend(Protocol):
    name: str

    def prepare(self, chunks: list[ScheduledChunk]) -> object:
        """Build the step's metadata (once per step, shared by all layers)."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
