"""Scheduler driven by hand: the engine's part (advance, sample, finish) is simulated here."""

import itertools
import random
from typing import NamedTuple

import pytest

from engine.request.batch import SchedulerOutput
from engine.request.sequence import Sequence, SequenceStatus
from engine.step.kv_cache import PageAllocator
from engine.step.scheduler import Scheduler
from shared.protocol import SamplingParams

_ids = itertools.count()


def make_seq(
    prompt_len: int, max_tokens: int, name: str | None = None, shared: bool = False
) -> Sequence:
    """A sequence with its own prompt, or with `shared`, one that starts 1, 2, 3, ... like
    every other shared one, so the prefix cache can share their pages."""
    number = next(_ids)
    first = 1 if shared else 10_000 * (number + 1)
    return Sequence(
        request_id=name or f"r{number}",
        token_ids=list(range(first, first + prompt_len)),
        num_prompt_tokens=prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        reply_to="tcp://nowhere",
        arrival_time=0.0,
        max_output_tokens=max_tokens,
    )


class Chunk(NamedTuple):
    """A scheduled chunk as it was when scheduled (`samples` is live on the real one)."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool


class Step(NamedTuple):
    chunks: list[Chunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Sim:
    """Plays the engine around a Scheduler and checks its invariants on every step."""

    def __init__(self, num_pages: int, page_size: int, budget: int, max_num_seqs: int = 64,
                 long_prefill_token_threshold: int = 0, kv_window: int | None = None):
        # No long-prefill cap unless a test asks: most tests check the plain mechanics.
        self.alloc = PageAllocator(num_pages, page_size)
        self.sched = Scheduler(self.alloc, budget, max_num_seqs,
                               long_prefill_token_threshold=long_prefill_token_threshold,
                               kv_window=kv_window)
        self.kv_window = kv_window
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.finished: list[Sequence] = []
        self.history: list[Step] = []

    def add(self, *seqs: Sequence) -> None:
        for seq in seqs:
            self.sched.add(seq)

    def step(self) -> Step:
        out = self.sched.schedule()
        self._check(out)
        step = Step(
            [Chunk(c.seq, c.start, c.num_tokens, c.samples) for c in out.chunks],
            list(out.preempted),
        )
        self.history.append(step)
        for chunk in step.chunks:
            seq = chunk.seq
            seq.num_computed += chunk.num_tokens
            self.sched.computed(seq)
            if chunk.samples:
                seq.token_ids.append(1000 + seq.num_output_tokens)
                if seq.num_output_tokens >= seq.max_output_tokens:
                    self.sched.finish(seq)
                    self.finished.append(seq)
        return step

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.sched.has_work:
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps

    def _check(self, out: SchedulerOutput) -> None:
        assert out.num_tokens <= self.budget
        assert len(out.chunks) <= self.max_num_seqs
        assert len(self.sched.running) <= self.max_num_seqs
        seen = set()
        for chunk in out.chunks:
            seq = chunk.seq
            assert seq.request_id not in seen, "a sequence scheduled twice in one step"
            seen.add(seq.request_id)
            assert chunk.num_tokens >= 1
            assert chunk.start == seq.num_computed
            assert chunk.start + chunk.num_tokens <= len(seq.token_ids)
            assert seq.status is SequenceStatus.RUNNING
            assert seq in self.sched.running
            # The pages must already cover every position written this step.
            needed = self.alloc.pages_needed(chunk.start + chunk.num_tokens)
            assert len(seq.pages) >= needed
            # Pages given back lie wholly behind the window of the chunk's first query.
            if seq.num_released_pages:
                first_seen = chunk.start - self.kv_window + 1
                assert seq.num_released_pages * self.alloc.page_size <= first_seen
        for seq in out.preempted:
            assert seq.request_id not in seen
        # Pages may be shared through the prefix cache: each page's owners match its
        # reference count, a shared page is a full page with the same tokens at the same
        # place in every owner, and distinct owned + free == total.
        owners: dict[int, list[tuple[Sequence, int]]] = {}
        for s in self.sched.running + self.sched.waiting:
            owned = s.pages[s.num_released_pages:]
            assert len(owned) == len(set(owned)), "a sequence owns a page twice"
            for index, page in enumerate(owned, start=s.num_released_pages):
                owners.setdefault(page, []).append((s, index))
        size = self.alloc.page_size
        for page, holders in owners.items():
            assert self.alloc.refcount(page) == len(holders)
            if len(holders) > 1:
                pieces = {tuple(s.token_ids[i * size : (i + 1) * size]) for s, i in holders}
                assert len({i for _, i in holders}) == 1 and len(pieces) == 1
                assert all(len(piece) == size for piece in pieces)
        assert len(owners) + self.alloc.num_free == self.alloc.num_pages


def test_single_short_prompt_prefill_then_decode():
    sim = Sim(num_pages=16, page_size=4, budget=32)
    seq = make_seq(5, max_tokens=3)
    sim.add(seq)
    out = sim.step()
    assert [(c.seq, c.start, c.num_tokens, c.samples) for c in out.chunks] == [(seq, 0, 5, True)]
    assert seq.status is SequenceStatus.RUNNING and len(seq.pages) == 2
    out = sim.step()
    assert [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [(5, 1, True)]
    out = sim.step()
    assert [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [(6, 1, True)]
    assert seq.status is SequenceStatus.FINISHED and seq.output_ids == [1000, 1001, 1002]
    assert not sim.sched.has_work
    assert sim.sched.schedule().chunks == []


def test_chunked_prefill_samples_only_on_last_chunk():
    sim = Sim(num_pages=32, page_size=4, budget=8)
    seq = make_seq(21, max_tokens=2)
    sim.add(seq)
    chunks = []
    for _ in range(3):
        [chunk] = sim.step().chunks
        chunks.append((chunk.start, chunk.num_tokens, chunk.samples))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 5, True)]
    assert seq.num_output_tokens == 1
    # Pages grow with the chunks rather than being taken all at once.
    assert len(seq.pages) == 6
    [chunk] = sim.step().chunks
    assert (chunk.start, chunk.num_tokens, chunk.samples) == (21, 1, True)
    assert seq.status is SequenceStatus.FINISHED


def test_pages_grow_one_chunk_at_a_time():
    sim = Sim(num_pages=32, page_size=4, budget=8)
    seq = make_seq(20, max_tokens=1)
    sim.add(seq)
    sim.step()
    assert len(seq.pages) == 2
    sim.step()
    assert len(seq.pages) == 4


def test_token_budget_respected_under_mixed_load():
    sim = Sim(num_pages=200, page_size=4, budget=16, max_num_seqs=6)
    lengths = [3, 40, 7, 16, 1, 25, 9, 2, 33, 12]
    seqs = [make_seq(n, max_tokens=5 + i % 4) for i, n in enumerate(lengths)]
    sim.add(*seqs[:4])
    sim.step()
    sim.step()
    sim.add(*seqs[4:])
    sim.run()
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == s.max_output_tokens for s in seqs)
    # The budget was actually the binding limit at some point.
    assert max(out.num_tokens for out in sim.history) == 16
    assert sim.alloc.num_free == sim.alloc.num_pages


def test_decodes_go_before_new_prefills():
    sim = Sim(num_pages=64, page_size=4, budget=10)
    a, b = make_seq(4, max_tokens=10), make_seq(4, max_tokens=10)
    sim.add(a, b)
    sim.step()  # both prefilled, 8 tokens
    c = make_seq(30, max_tokens=2)
    sim.add(c)
    out = sim.step()
    # a and b decode first (1 token each); c gets only what is left of the budget.
    assert [(x.seq, x.num_tokens) for x in out.chunks] == [(a, 1), (b, 1), (c, 8)]
    assert not out.chunks[2].samples
    # While c's long prefill continues, a and b keep decoding every step.
    for _ in range(3):
        out = sim.step()
        assert [x.seq for x in out.chunks[:2]] == [a, b]
        assert all(x.num_tokens == 1 and x.samples for x in out.chunks[:2])
        assert out.num_tokens <= 10


def test_continuous_batching_new_requests_join_running_ones():
    sim = Sim(num_pages=64, page_size=4, budget=64)
    a = make_seq(6, max_tokens=8)
    sim.add(a)
    sim.step()
    sim.step()
    b = make_seq(5, max_tokens=3)
    sim.add(b)
    out = sim.step()
    assert [(x.seq, x.start, x.num_tokens) for x in out.chunks] == [(a, 7, 1), (b, 0, 5)]
    # b finishes while a keeps decoding, and a later arrival joins a in flight.
    sim.step()
    sim.step()
    assert b.status is SequenceStatus.FINISHED and a.status is SequenceStatus.RUNNING
    c = make_seq(3, max_tokens=1)
    sim.add(c)
    out = sim.step()
    assert [x.seq for x in out.chunks] == [a, c]
    sim.run()
    assert a.num_output_tokens == 8
    assert max(len(o.chunks) for o in sim.history) == 2


def test_waiting_admitted_in_arrival_order():
    sim = Sim(num_pages=64, page_size=4, budget=10)
    seqs = [make_seq(4, max_tokens=1) for _ in range(4)]
    sim.add(*seqs)
    out = sim.step()
    # 4 + 4 + 2 tokens: the third starts a chunk, the fourth waits its turn.
    assert [(x.seq, x.num_tokens) for x in out.chunks] == [(seqs[0], 4), (seqs[1], 4), (seqs[2], 2)]
    assert list(sim.sched.waiting) == [seqs[3]]


def test_max_num_seqs_caps_running():
    sim = Sim(num_pages=64, page_size=4, budget=100, max_num_seqs=2)
    seqs = [make_seq(3, max_tokens=3) for _ in range(5)]
    sim.add(*seqs)
    out = sim.step()
    assert [x.seq for x in out.chunks] == seqs[:2]
    assert len(sim.sched.running) == 2 and len(sim.sched.waiting) == 3
    sim.step()
    assert [x.seq for x in sim.history[-1].chunks] == seqs[:2]
    sim.step()  # seqs 0 and 1 finish here
    out = sim.step()
    assert [x.seq for x in out.chunks] == seqs[2:4]
    sim.run()
    assert all(len(o.chunks) <= 2 for o in sim.history)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)


def test_preemption_evicts_most_recent_and_recomputes():
    # 6 pages of 4 tokens: three 8-token prompts fill the cache exactly.
    sim = Sim(num_pages=6, page_size=4, budget=64)
    a, b, c = (make_seq(8, max_tokens=4, name=n) for n in "abc")
    sim.add(a, b, c)
    out = sim.step()
    assert [x.seq for x in out.chunks] == [a, b, c]
    assert sim.alloc.num_free == 0
    c_output = list(c.output_ids)

    # Every decode now needs a third page: c, the last admitted, is evicted for a and b.
    out = sim.step()
    assert out.preempted == [c]
    assert [x.seq for x in out.chunks] == [a, b]
    assert c.status is SequenceStatus.WAITING
    assert c.pages == [] and c.num_computed == 0
    assert list(sim.sched.waiting) == [c]
    assert c not in sim.sched.running
    assert len(a.pages) == 3 and len(b.pages) == 3 and sim.alloc.num_free == 0
    # Its generated token survives the eviction and will be recomputed, not redrawn.
    assert c.output_ids == c_output and len(c.token_ids) == 9

    sim.run()
    assert [s.request_id for s in sim.finished][:2] == ["a", "b"]
    assert all(s.status is SequenceStatus.FINISHED for s in (a, b, c))
    assert all(s.num_output_tokens == 4 for s in (a, b, c))
    assert c.output_ids[:1] == c_output
    # c's readmission recomputes prompt + generated token in one chunk and then samples.
    readmit = next(x for o in sim.history[2:] for x in o.chunks if x.seq is c and x.start == 0)
    assert readmit.num_tokens == 9 and readmit.samples
    assert sim.alloc.num_free == 6


def test_preempted_sequence_goes_to_front_of_waiting():
    sim = Sim(num_pages=4, page_size=4, budget=64, max_num_seqs=2)
    a, b, d = (make_seq(8, max_tokens=3, name=n) for n in "abd")
    sim.add(a, b, d)
    sim.step()  # a and b admitted (max_num_seqs=2), cache full
    assert list(sim.sched.waiting) == [d]
    out = sim.step()
    assert out.preempted == [b]
    # b is ahead of d, which arrived later but has never run.
    assert list(sim.sched.waiting) == [b, d]
    # Nothing is admitted in a step that had to preempt.
    assert [x.seq for x in out.chunks] == [a]
    sim.run()
    assert all(s.num_output_tokens == 3 for s in (a, b, d))
    assert sim.alloc.num_free == 4


def test_several_preemptions_in_one_step_keep_order():
    sim = Sim(num_pages=8, page_size=2, budget=64)
    seqs = [make_seq(4, max_tokens=2, name=f"s{i}") for i in range(4)]
    sim.add(*seqs)
    sim.step()  # 4 x 2 pages, full
    # s0's decode needs a page: s3 is evicted. s1 takes the spare one s3 left; s2 then finds
    # none and, being last in line, evicts itself.
    out = sim.step()
    assert out.preempted == [seqs[3], seqs[2]]
    assert list(sim.sched.waiting) == [seqs[2], seqs[3]]
    sim.run()
    assert all(s.num_output_tokens == 2 for s in seqs)
    assert sim.alloc.num_free == 8


def test_sequence_preempts_itself_when_it_is_the_last_admitted():
    sim = Sim(num_pages=3, page_size=4, budget=64)
    a, b = make_seq(6, max_tokens=6, name="a"), make_seq(4, max_tokens=2, name="b")
    sim.add(a, b)
    sim.step()  # a: 2 pages, b: 1 page; the cache is full
    out = sim.step()  # a still fits its 2 pages; b needs a second page and is the victim
    assert out.preempted == [b]
    assert [x.seq for x in out.chunks] == [a]
    assert b.status is SequenceStatus.WAITING and b.pages == [] and b.num_computed == 0
    sim.run()
    assert a.num_output_tokens == 6 and b.num_output_tokens == 2
    assert sim.alloc.num_free == 3


def test_finish_frees_pages_of_running_and_waiting():
    sim = Sim(num_pages=16, page_size=4, budget=8)
    running = make_seq(12, max_tokens=5)
    waiting = make_seq(4, max_tokens=5)
    sim.add(running, waiting)
    sim.step()  # 8 tokens of `running`, budget spent
    assert len(running.pages) == 2 and sim.alloc.num_free == 14
    sim.sched.finish(running)
    assert running.status is SequenceStatus.FINISHED and running.pages == []
    assert sim.alloc.num_free == 16
    assert running not in sim.sched.running
    sim.sched.finish(waiting)
    assert waiting.status is SequenceStatus.FINISHED
    assert not sim.sched.has_work
    assert sim.sched.schedule().chunks == []


def test_finish_mid_decode_lets_a_waiting_one_in():
    sim = Sim(num_pages=2, page_size=4, budget=64)
    a, b = make_seq(6, max_tokens=100), make_seq(4, max_tokens=1)
    sim.add(a, b)
    out = sim.step()
    assert [x.seq for x in out.chunks] == [a]  # b does not fit
    sim.sched.finish(a)
    out = sim.step()
    assert [x.seq for x in out.chunks] == [b]


@pytest.mark.parametrize("kv_window", [None, 5])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("budget", [1, 3, 16, 128])
@pytest.mark.parametrize("num_pages", [8, 64])
def test_random_workload_drains_and_frees_everything(budget, num_pages, shared, kv_window):
    rng = random.Random(budget * 1000 + num_pages)
    sim = Sim(num_pages=num_pages, page_size=4, budget=budget, max_num_seqs=5,
              kv_window=kv_window)
    # Every sequence fits the cache on its own (8 pages * 4 = 32 tokens). With `shared`,
    # prompts share prefixes, so pages are shared too (Sim checks their bookkeeping).
    seqs = [
        make_seq(rng.randint(1, 20), max_tokens=rng.randint(1, 12), shared=shared)
        for _ in range(12)
    ]
    pending = list(seqs)
    steps = 0
    while pending or sim.sched.has_work:
        for _ in range(rng.randint(0, 2)):
            if pending:
                sim.add(pending.pop(0))
        if sim.sched.has_work:
            sim.step()
        steps += 1
        assert steps < 5000
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == s.max_output_tokens for s in seqs)
    assert sim.alloc.num_free == num_pages
    assert not sim.sched.running and not sim.sched.waiting
    if shared:
        assert sim.alloc.prefix_hits > 0


# --- sliding windows: pages wholly behind every layer's window go back ---------------------


def test_a_windowed_generation_holds_a_bounded_number_of_pages():
    """80 tokens need 20 pages of 4; with a window of 8 a sequence holds at most the pages
    its next chunk's queries can see (window - 1 + chunk tokens) plus one of rounding, so 8
    pages are enough and nothing is ever preempted."""
    sim = Sim(num_pages=8, page_size=4, budget=8, kv_window=8)
    seq = make_seq(20, max_tokens=60)
    sim.add(seq)
    held = []
    while sim.sched.has_work:
        step = sim.step()
        assert not step.preempted
        if seq.pages:
            held.append(len(seq.pages) - seq.num_released_pages)
    assert seq.num_output_tokens == 60 and sim.alloc.num_free == 8
    assert max(held) <= -(-(8 - 1 + 8) // 4) + 1
    assert held[-1] <= -(-8 // 4) + 1  # decoding: the window's pages and the new token's


def test_without_a_window_the_same_generation_is_preempted():
    """The control: with every page kept, 8 pages cannot hold the 80 tokens."""
    sim = Sim(num_pages=8, page_size=4, budget=8)
    sim.add(make_seq(20, max_tokens=60))
    with pytest.raises(AssertionError, match="no progress"):
        sim.run(max_steps=300)


def test_released_pages_stay_in_the_prefix_cache():
    """A page released behind the window was registered when filled: the next request with
    the same prompt finds it (prefix caching is unchanged), and at once releases the
    cached pages behind its own window again."""
    sim = Sim(num_pages=64, page_size=4, budget=8, kv_window=8)
    first = make_seq(30, max_tokens=4, shared=True)
    sim.add(first)
    sim.run()
    assert sim.alloc.num_free == 64
    second = make_seq(30, max_tokens=4, shared=True)
    sim.add(second)
    [chunk] = sim.step().chunks
    assert second.num_cached_tokens == 28  # the 7 full prompt pages (the last token runs)
    assert chunk.start == 28 and second.num_released_pages == (28 - 8 + 1) // 4
    sim.run()
    assert second.output_ids == first.output_ids


def test_kv_window_must_be_positive():
    with pytest.raises(ValueError, match="kv_window must be positive"):
        Scheduler(PageAllocator(8, 4), 8, 4, kv_window=0)


# --- long prefills (issue 15: a long prompt must not stall the others) ----------------------


def test_short_prompts_arriving_behind_a_long_one_run_in_the_next_step():
    sim = Sim(num_pages=400, page_size=4, budget=64, long_prefill_token_threshold=16)
    long = make_seq(1000, max_tokens=2)
    sim.add(long)
    out = sim.step()
    assert [(x.seq, x.num_tokens) for x in out.chunks] == [(long, 64)]  # alone: all of it
    shorts = [make_seq(5, max_tokens=3) for _ in range(4)]
    sim.add(*shorts)
    out = sim.step()
    # The long prefill keeps going, at the threshold; every short prompt is prefilled.
    assert [(x.seq, x.num_tokens) for x in out.chunks] == [(long, 16)] + [(s, 5) for s in shorts]
    out = sim.step()
    # Their decodes go on next to the long prefill, which takes no more than the threshold.
    assert [(x.seq, x.num_tokens) for x in out.chunks] == [(long, 16)] + [(s, 1) for s in shorts]
    sim.run()
    assert all(s.status is SequenceStatus.FINISHED for s in [long, *shorts])
    assert sim.alloc.num_free == sim.alloc.num_pages


def test_a_long_prompt_behind_running_decodes_gets_the_threshold():
    sim = Sim(num_pages=400, page_size=4, budget=64, long_prefill_token_threshold=16)
    a = make_seq(4, max_tokens=20)
    sim.add(a)
    sim.step()
    long = make_seq(500, max_tokens=1)
    sim.add(long)
    for _ in range(3):
        out = sim.step()
        assert [(x.seq, x.num_tokens) for x in out.chunks] == [(a, 1), (long, 16)]


def test_one_long_prefill_at_a_time_while_short_work_waits():
    sim = Sim(num_pages=800, page_size=4, budget=64, long_prefill_token_threshold=16)
    long1, long2 = make_seq(300, max_tokens=1), make_seq(300, max_tokens=1)
    short = make_seq(5, max_tokens=4)
    sim.add(long1, long2, short)
    out = sim.step()
    # long2 waits its turn rather than eat the budget the short one needs.
    assert [(x.seq, x.num_tokens) for x in out.chunks] == [(long1, 16), (short, 5)]
    assert long2 in sim.sched.waiting and not long2.pages
    sim.run()
    # Once only long prompts are left, they take the whole budget again.
    assert max(o.num_tokens for o in sim.history) == 64
    assert all(s.status is SequenceStatus.FINISHED for s in [long1, long2, short])
    assert sim.alloc.num_free == sim.alloc.num_pages


def test_the_tail_of_a_long_prompt_is_short():
    sim = Sim(num_pages=400, page_size=4, budget=64, long_prefill_token_threshold=16)
    long = make_seq(80, max_tokens=1)
    sim.add(long)
    sim.step()  # 64 of 80 alone
    d = make_seq(3, max_tokens=5)
    sim.add(d)
    out = sim.step()
    assert [(x.seq, x.num_tokens, x.samples) for x in out.chunks] == [(long, 16, True),
                                                                     (d, 3, True)]


@pytest.mark.parametrize("threshold", [1, 3, 16])
def test_random_workload_with_a_threshold_drains(threshold):
    rng = random.Random(threshold)
    sim = Sim(num_pages=60, page_size=4, budget=24, max_num_seqs=8,
              long_prefill_token_threshold=threshold)
    seqs = [make_seq(rng.randint(1, 90), max_tokens=rng.randint(1, 6)) for _ in range(30)]
    for i in range(0, 30, 3):
        sim.add(*seqs[i : i + 3])
        sim.step()
    sim.run(max_steps=5000)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert sim.alloc.num_free == sim.alloc.num_pages


def test_default_threshold_is_a_quarter_of_the_budget():
    sched = Scheduler(PageAllocator(8, 4), 512, 8)
    assert sched.long_prefill_token_threshold == 128
