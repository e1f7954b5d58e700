"""Small records that the runner, the drafter and a sequence share.

They live below all three so that none imports another for a type: the runner makes
`SampledToken`s, the drafter verifies them, and a sequence keeps its `DraftState`.
"""

from __future__ import annotations

import msgspec

from shared.protocol import TokenLogprobs
from shared.trace_context import TraceParent


class SampledToken(msgspec.Struct):
    token: int
    logprob: float | None = None  # the chosen token's, when the request wants logprobs
    logprobs: TokenLogprobs | None = None


class DraftState(msgspec.Struct):
    """One sequence's record: how well its drafts do, and how long it sits out."""

    rate: float = 1.0  # moving average of accepted / proposed
    paused: int = 0  # steps left without drafting


class RequestTrace(msgspec.Struct):
    """What a traced request's engine span is made of, stamped as it runs (a counter per
    prefill chunk, a time per preemption): the span itself is written once, at its end
    (engine.step.tracing)."""

    parent: TraceParent
    prefill_chunks: int = 0
    preempted_at: list[float] = msgspec.field(default_factory=list)
    resumed_tokens: int = 0  # a continuation's tokens drawn by another engine (migration)
