"""Small records that the runner, the drafter and a sequence share.

They live below all three so that none imports another for a type: the runner makes
`SampledToken`s, the drafter verifies them, and a sequence keeps its `DraftState`.
"""

from __future__ import annotations

import msgspec

from shared.protocol import TokenLogprobs


class SampledToken(msgspec.Struct):
    token: int
    logprob: float | None = None  # the chosen token's, when the request wants logprobs
    logprobs: TokenLogprobs | None = None


class DraftState(msgspec.Struct):
    """One sequence's record: how well its drafts do, and how long it sits out."""

    rate: float = 1.0  # moving average of accepted / proposed
    paused: int = 0  # steps left without drafting
