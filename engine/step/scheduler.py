"""Continuous batching: which sequences run in the next step, and how many tokens of each.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first (a decode
costs one token, an unfinished prefill continues with the next chunk), then waiting ones are
admitted in queue order while budget, pages and `max_num_seqs` allow. A prompt longer than
the budget is prefilled in chunks over several steps. While anything else wants to run, a
long prefill (more than `long_prefill_token_threshold` tokens left) takes at most that many
tokens a step, and only one long prefill runs at a time, so decodes and short prompts
always get into the next step (issue 15); alone, it takes the whole budget.

Queue order is arrival (`fcfs`) or (tier, priority, arrival) (`priority`: a higher
TensorRT-LLM priority_tier first, then the lower vLLM priority). When pages
run out, the running sequence that comes last in that order is preempted: its pages are
released (full ones stay in the prefix cache) and it goes back to the queue to be recomputed,
so nothing is lost. On admission a sequence takes every leading full page the prefix cache
already holds and skips their prefill. With LoRA, running sequences use at most
`max_loras` adapters; a request for one more waits in the queue (others pass it).

A page enters the prefix cache when it is scheduled to be filled, not after the step: backends
store every new K/V of a step before any attention reads the cache, so a sequence admitted
later in the same step (the n candidates of one request, or the same system prompt arriving
together) reads pages another sequence fills in that very step, and the prompt is prefilled
once. Such a reader is always scheduled in the same step as the writer, since a lookup happens
only on admission.

With speculative decoding (`drafter`), a decoding sequence may feed a draft after its last
token: the chunk is 1 + len(draft) tokens of the budget, like a prefill, with pages for all
of them. Draft pages are never registered (their tokens are not known yet); the core
registers what verification accepted and hands back the pages past the need
(`drop_unused_pages`). A draft never preempts anything: without free pages for it, the
sequence decodes plainly.

Sliding windows (`kv_window`, set when every layer of the model has one): before a
sequence's next chunk is scheduled, its leading pages that lie wholly behind the window of
the chunk's first token are released, so a long generation holds about window / page_size
pages, not its whole context. They were registered when filled, so they wait in the prefix
cache like any released page (a later request with that prefix still finds them, until
they are recycled); their ids stay in the sequence's page list, where the backends read
them only under the window's mask. A model with any full-attention layer (Gemma, gpt-oss)
keeps every page.
"""

from __future__ import annotations

import bisect
import itertools

from engine.request.batch import ScheduledChunk, SchedulerOutput
from engine.request.sequence import Sequence, SequenceStatus
from engine.step.kv_cache import OutOfPages, PageAllocator, chain_hash, root_hash
from engine.step.multimodal import cache_key
from engine.step.spec_decode import Drafter

POLICIES = ("fcfs", "priority")


def default_long_prefill_threshold(max_num_batched_tokens: int) -> int:
    """A quarter of the step budget (128 of the default 512), measured in docs/benchmarks.md:
    short chats behind an 8,191-token prompt get their first token in about a second."""
    return max(1, max_num_batched_tokens // 4)


class _LongPrefills:
    """One step's share for long prefills (more than `cap` tokens left). With a cap, one long
    prefill gets `cap` tokens and the others wait (in queue order, vLLM's
    max_long_partial_prefills=1), so decodes and short prompts keep the rest of the budget
    however many long prompts arrive; without one, everything takes what the budget allows."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.taken = False

    def take(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to schedule now (0: not this step)."""
        n = min(seq.num_uncomputed, budget)
        if self.cap is None or seq.num_uncomputed <= self.cap:
            return n
        if self.taken:
            return 0
        self.taken = True
        return min(n, self.cap)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        policy: str = "fcfs",
        long_prefill_token_threshold: int | None = None,
        drafter: Drafter | None = None,
        max_loras: int = 0,
        kv_window: int | None = None,
    ) -> None:
        """kv_window: ModelConfig.kv_window, the window every layer attends within (None:
        some layer attends the whole context, and no page is released early)."""
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}")
        self.allocator = allocator
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # None: a quarter of the step budget; 0: no cap (a long prompt takes the budget).
        if long_prefill_token_threshold is None:
            long_prefill_token_threshold = default_long_prefill_threshold(max_num_batched_tokens)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = policy
        self.drafter = drafter  # None: no speculative decoding
        # Distinct LoRA adapters in one step (--max-loras): a request for another one waits
        # in the queue until a running adapter's requests are done; none is ever evicted.
        self.max_loras = max_loras
        if kv_window is not None and kv_window < 1:
            raise ValueError(f"kv_window must be positive, not {kv_window}")
        self.kv_window = kv_window
        self.waiting: list[Sequence] = []  # kept sorted by _key
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _key(self, seq: Sequence) -> tuple[int, int, int]:
        if self.policy != "priority":
            return (0, 0, seq.order)
        # TensorRT-LLM's priority_tier: a higher tier dominates every lower one.
        return (-seq.priority_tier, seq.priority, seq.order)

    def add(self, seq: Sequence) -> None:
        seq.order = next(self._arrivals)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=self._key)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        longs = _LongPrefills(self._long_cap())
        room = (0 if self.drafter is None else  # draft tokens this step may still take
                self.drafter.room(len(self.running), len(self.waiting)))

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = longs.take(seq, budget)
            if n == 0:
                i += 1  # a long prefill waits for the one this step already has
                continue
            self._release_behind_window(seq)
            draft = self._draft(seq, n, min(budget - 1, room)) if room else []
            room -= len(draft)
            if not self._reserve_pages(seq, n, preempted):
                break  # seq itself was preempted; everything after it is gone too
            self._register_pages(seq, seq.num_computed + n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n + len(draft), draft))
            budget -= n + len(draft)
            i += 1

        self._admit_waiting(chunks, preempted, longs, budget)
        return SchedulerOutput(chunks, preempted)

    def _admit_waiting(self, chunks: list[ScheduledChunk], preempted: list[Sequence],
                       longs: _LongPrefills, budget: int) -> None:
        """Moves waiting sequences, in queue order, into the running batch while the step's
        token `budget`, the sequence cap and the KV pages allow; each starts with a chunk."""
        j = 0  # the first waiting sequence not passed over
        adapters = {s.lora_id for s in self.running if s.lora_id}
        while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            if preempted:
                break  # memory is short this step; don't admit what we just evicted
            seq = self.waiting[j]
            if seq.awaiting_grammar:
                j += 1  # its grammar is still compiling: it keeps its place, others go first
                continue
            if seq.lora_id and seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                j += 1  # every adapter slot is taken: it keeps its place, others go first
                continue
            if seq.pooling is not None:
                # Pooled whole in one step (a bidirectional encoder cannot be chunked, and a
                # pooled vector needs every row at once); the engine makes the step budget
                # hold max_model_len. No prefix cache: its pages die with it.
                if seq.num_uncomputed > budget:
                    break  # next step, at the head of the queue
                n = seq.num_uncomputed
            else:
                if seq.num_computed == 0 and not seq.pages:
                    self._take_cached_prefix(seq)
                    self._release_behind_window(seq)
                n = longs.take(seq, budget)
            if n == 0:
                # A long prompt while another one prefills: short ones go first. Its cached
                # prefix stays in the prefix cache, as when pages run out below.
                self._free_pages(seq)
                j += 1
                continue
            if not self._try_grow(seq, n):
                # A waiting sequence holds no pages, or it could starve the running ones;
                # its cached pages stay in the prefix cache for the next attempt.
                self._free_pages(seq)
                break
            self.waiting.pop(j)
            if seq.lora_id:
                adapters.add(seq.lora_id)
            seq.status = SequenceStatus.RUNNING
            # Running stays in queue order too, so the victim of a preemption (the last one)
            # is never a sequence already scheduled earlier in this step.
            bisect.insort(self.running, seq, key=self._key)
            self._register_pages(seq, seq.num_computed + n)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n

    def _long_cap(self) -> int | None:
        """The most tokens a long prefill may take this step: the threshold while anything
        else (a decode, a short prompt) wants to run, else no cap, since then nobody waits
        behind it and smaller chunks would only slow it down."""
        threshold = self.long_prefill_token_threshold
        if threshold <= 0:
            return None
        others = (s for s in itertools.chain(self.running, self.waiting)
                  if not s.awaiting_grammar)
        if any(s.num_uncomputed <= threshold for s in others):
            return threshold
        return None

    def _draft(self, seq: Sequence, n: int, room: int) -> list[int]:
        """A decoding sequence's draft of at most `room` tokens, with its pages already
        taken; [] when it has none or no free page can hold it (a draft preempts nobody)."""
        if n != 1 or seq.num_output_tokens == 0:
            return []  # a prefill chunk: its last row is the first to sample
        # The token drawn after the draft must still fit in max_tokens.
        limit = min(room, seq.max_output_tokens - seq.num_output_tokens - 1)
        batched = len(self.running) > 1
        draft = self.drafter.propose(seq, limit, batched) if limit > 0 else []
        if not draft:
            return []
        alloc = self.allocator
        extra = alloc.pages_needed(seq.num_computed + 1 + len(draft)) - len(seq.pages)
        # A page left for every running sequence's next token, so that no one is preempted
        # later in this step for pages a draft took.
        if extra > 0 and alloc.num_free - extra < len(self.running):
            return []
        if not self._try_grow(seq, 1 + len(draft)):
            return []
        return draft

    def drop_unused_pages(self, seq: Sequence) -> None:
        """After verifying a draft: pages past the known tokens (the rejected part of the
        draft) go back; none of them is in the prefix cache."""
        keep = self.allocator.pages_needed(len(seq.token_ids))
        if len(seq.pages) > keep:
            self.allocator.release(seq.pages[keep:])
            del seq.pages[keep:]

    def computed(self, seq: Sequence) -> None:
        """After a step: make sure every filled full page is in the prefix cache (they were
        registered when scheduled, so this is normally a no-op)."""
        self._register_pages(seq, seq.num_computed)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and return its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._free_pages(seq)
        seq.status = SequenceStatus.FINISHED

    # ---------------------------------------------------------------- prefix cache

    def _extend_hashes(self, seq: Sequence, num_pages: int) -> None:
        size = self.allocator.page_size
        while len(seq.page_hashes) < num_pages:
            i = len(seq.page_hashes)
            parent = seq.page_hashes[-1] if i else root_hash(seq.cache_salt, seq.lora_id)
            if seq.images:  # the images a page's tokens show are part of what it holds
                parent += cache_key(seq.images, i * size, (i + 1) * size)
            seq.page_hashes.append(chain_hash(parent, seq.token_ids[i * size : (i + 1) * size]))

    def _register_pages(self, seq: Sequence, num_filled: int) -> None:
        """Record the full pages among the first `num_filled` tokens in the prefix cache."""
        if seq.pooling is not None:
            return  # a pooling request's pages are never shared (and a bidirectional
            # encoder's K/V of a prefix depends on what follows it)
        full = num_filled // self.allocator.page_size
        if full <= seq.num_registered_pages:
            return
        self._extend_hashes(seq, full)
        new = [i for i in range(seq.num_registered_pages, full)
               if self.allocator.register(seq.pages[i], seq.page_hashes[i])]
        seq.num_registered_pages = full
        if new and self.allocator.events is not None:
            self.allocator.events.stored(seq.page_hashes, new, seq.token_ids,
                                         self.allocator.page_size, seq.lora_id, seq.lora_name)

    def _take_cached_prefix(self, seq: Sequence) -> None:
        # At least one token must still be computed: its logits give the next token.
        cacheable = (len(seq.token_ids) - 1) // self.allocator.page_size
        if seq.params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt token's logits, which cached pages do not
            # keep: such a prompt is computed whole (as vLLM does); its pages still fill
            # the cache for others.
            cacheable = 0
        self._extend_hashes(seq, cacheable)
        pages = self.allocator.cached_prefix(seq.page_hashes[:cacheable])
        seq.pages = pages
        seq.num_computed = len(pages) * self.allocator.page_size
        seq.num_registered_pages = len(pages)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed

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
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def _free_pages(self, seq: Sequence) -> None:
        self.allocator.release(seq.pages[seq.num_released_pages:])
        seq.pages = []
        seq.num_computed = 0
        seq.num_registered_pages = 0
        seq.num_released_pages = 0

    def _release_behind_window(self, seq: Sequence) -> None:
        """Give back the leading pages no query from seq.num_computed on can see: the
        first one sees keys from num_computed - kv_window + 1, and later ones see less far
        back. Released pages keep their prefix-cache entries (registered when filled)."""
        if self.kv_window is None:
            return
        first_seen = seq.num_computed - self.kv_window + 1
        behind = min(max(0, first_seen) // self.allocator.page_size, len(seq.pages))
        if behind > seq.num_released_pages:
            self._register_pages(seq, seq.num_computed)  # normally done already
            self.allocator.release(seq.pages[seq.num_released_pages:behind])
            seq.num_released_pages = behind
