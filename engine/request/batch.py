"""One step's batch, as the scheduler plans it and the runner, attention backends and models
read it: which sequences run, from which position, and how many tokens of each.

Its own module so that backends and models depend on the batch, not on the scheduler."""

from __future__ import annotations

import msgspec

from engine.request.sequence import Sequence


class ScheduledChunk(msgspec.Struct):
    seq: Sequence
    start: int  # position of the first token fed this step
    num_tokens: int  # including the draft
    # Speculative tokens fed after the known ones, to be verified (engine.step.spec_decode).
    draft: list[int] = []

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is drawn
        (a pooling request's never: it is pooled instead)."""
        return (self.seq.pooling is None
                and self.start + self.num_tokens - len(self.draft) == len(self.seq.token_ids))


class SchedulerOutput(msgspec.Struct):
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)
