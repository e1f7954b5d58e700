"""Continuous batching: which sequences run in the next step, and how many tokens of each.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first (a decode
costs one token, an unfinished prefill continues with the next chunk), then waiting ones are
admitted in arrival order while budget, pages and `max_num_seqs` allow. A prompt longer than
the budget is prefilled in chunks over several steps, so long prompts never stall decodes.
When pages run out, the most recently admitted sequence is preempted: its pages are freed and
it goes back to the front of the queue to be recomputed later, so nothing is lost.
"""

from __future__ import annotations

from collections import deque

import msgspec

from engine.kv_cache import OutOfPages, PageAllocator
from engine.sequence import Sequence, SequenceStatus


class ScheduledChunk(msgspec.Struct):
    seq: Sequence
    start: int  # position of the first token fed this step
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is drawn."""
        return self.start + self.num_tokens == len(self.seq.token_ids)


class SchedulerOutput(msgspec.Struct):
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self, allocator: PageAllocator, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        self.allocator = allocator
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if not self._reserve_pages(seq, n, preempted):
                break  # seq itself was preempted; everything after it is gone too
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if preempted:
                break  # memory is short this step; don't admit what we just evicted
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if not self._try_grow(seq, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n

        return SchedulerOutput(chunks, preempted)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and return its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._free_pages(seq)
        seq.status = SequenceStatus.FINISHED

    # ---------------------------------------------------------------- pages

    def _try_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.allocator.pages_needed(seq.num_computed + num_new_tokens) - len(seq.pages)
        if needed <= 0:
            return True
        try:
            seq.pages.extend(self.allocator.allocate(needed))
        except OutOfPages:
            return False
        return True

    def _reserve_pages(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        while not self._try_grow(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_pages(seq)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _free_pages(self, seq: Sequence) -> None:
        self.allocator.release(seq.pages)
        seq.pages = []
