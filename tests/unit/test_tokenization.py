"""The input stage's threads (req T-8, T-9): tokenizer copies, render timeouts, stuck workers."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from frontend.base.api_models import ChatMessage
from frontend.input import input_metrics, tokenization
from frontend.input.budgets import BudgetError, TokenizeParams
from frontend.input.rendering import RenderParams
from frontend.input.tokenization import InputSettings, RenderTimeout, Tokenization
from shared.tokenizer import load_tokenizer, tokenizer_facts

HANG = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
        "never")
HI = [ChatMessage(role="user", content="hi")]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


@pytest.fixture(scope="module")
def max_chars(tokenizer):
    return tokenizer_facts(tokenizer, "default").max_chars_per_token


def make_stage(tokenizer, max_chars, threads=1, timeout=30.0) -> Tokenization:
    settings = InputSettings(max_chars_per_token=max_chars, threads=threads,
                             render_timeout_s=timeout)
    return Tokenization(tokenizer, settings)


def live_workers() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tokenize-"))


def wait_until(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------- copies (T-9)


def test_pool_grows_when_every_copy_is_lent(tokenizer, max_chars):
    stage = make_stage(tokenizer, max_chars)
    try:
        with stage.pool.borrow() as a, stage.pool.borrow() as b:
            assert a is not b and a is not tokenizer  # the prototype is never lent
        assert stage.pool.copies == 2
        with stage.pool.borrow():
            pass
        assert stage.pool.copies == 2  # returned copies are reused
    finally:
        stage.shutdown()


def test_many_threads_get_exactly_the_serial_results(tokenizer, max_chars):
    texts = [f"Request {i}: " + "naïve café 你好 " * (i % 13) + "ok" * i for i in range(96)]
    variants = [
        TokenizeParams(max_total_tokens=4096),
        TokenizeParams(max_total_tokens=4096, add_special_tokens=False, return_offsets=True),
        TokenizeParams(max_total_tokens=64, truncate_prompt_tokens=-1),
        TokenizeParams(max_total_tokens=64, truncate_prompt_tokens=5, truncation_side="right"),
    ]
    jobs = [(t, p) for t in texts for p in variants]
    serial_stage = make_stage(tokenizer, max_chars)
    stage = make_stage(tokenizer, max_chars, threads=8)
    try:
        serial = [serial_stage.tokenize_sync(t, p) for t, p in jobs]
        with ThreadPoolExecutor(16) as threads:  # raw threads on the pool of copies
            assert list(threads.map(lambda j: stage.tokenize_sync(*j), jobs)) == serial

        async def through_the_workers():
            return await asyncio.gather(*(stage.tokenize(t, p) for t, p in jobs))

        assert asyncio.run(through_the_workers()) == serial
    finally:
        serial_stage.shutdown()
        stage.shutdown()


# ---------------------------------------------------------------- character ceiling (T-5)


def test_multi_megabyte_prompt_never_reaches_the_tokenizer(tokenizer, max_chars, monkeypatch):
    stage = make_stage(tokenizer, max_chars)
    borrows = []
    real_borrow = stage.pool.borrow

    def counting_borrow():
        borrows.append(1)
        return real_borrow()

    monkeypatch.setattr(stage.pool, "borrow", counting_borrow)
    params = TokenizeParams(max_total_tokens=8192)
    chars_before = input_metrics.TOKENIZER_CHARS._value.get()

    async def run():
        started = time.perf_counter()
        with pytest.raises(BudgetError, match="5000000 characters"):
            await stage.tokenize("z" * 5_000_000, params)
        rejected_in = time.perf_counter() - started
        assert borrows == [] and input_metrics.TOKENIZER_CHARS._value.get() == chars_before
        await stage.tokenize("a normal prompt", params)  # the counter does count
        assert borrows == [1]
        return rejected_in

    try:
        assert asyncio.run(run()) < 1.0
    finally:
        stage.shutdown()


def test_the_event_loop_keeps_running_while_a_long_prompt_tokenizes(tokenizer, max_chars):
    """A worker thread is not enough: the tokenizer must also let go of the GIL."""
    stage = make_stage(tokenizer, max_chars)
    params = TokenizeParams(max_total_tokens=8192)
    text = ("The quick brown fox jumps over the lazy dog; " * 15000)[:8000 * max_chars]

    async def run():
        gaps, done = [], asyncio.Event()

        async def tick():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        started = time.perf_counter()
        with pytest.raises(BudgetError, match="at least 8193 tokens"):
            await stage.tokenize(text, params)
        took = time.perf_counter() - started
        done.set()
        await ticker
        return took, max(gaps)

    try:
        took, longest_gap = asyncio.run(run())
        assert longest_gap < took / 3, (took, longest_gap)
    finally:
        stage.shutdown()


# ---------------------------------------------------------------- render timeout (T-8)


def test_a_looping_template_times_out_and_its_thread_stops(tokenizer, max_chars):
    stage = make_stage(tokenizer, max_chars, threads=1, timeout=0.5)
    timeouts_before = input_metrics.RENDER_TIMEOUTS._value.get()

    async def run():
        started = time.perf_counter()
        with pytest.raises(RenderTimeout, match="longer than 0.5 s"):
            await stage.render_chat(HI, RenderParams(request_template=HANG))
        elapsed = time.perf_counter() - started
        # One worker, and it was stuck: this render runs on its replacement.
        rendered = await stage.render_chat(HI, RenderParams())
        return elapsed, rendered

    try:
        elapsed, rendered = asyncio.run(run())
        assert 0.4 < elapsed < 3.0
        assert rendered.text.endswith("<|im_start|>assistant\n")
        assert input_metrics.RENDER_TIMEOUTS._value.get() == timeouts_before + 1
        # The Jinja loop runs Python bytecode, so the interrupt ends the stuck thread.
        assert wait_until(lambda: live_workers() == ["tokenize-1"]), live_workers()
    finally:
        stage.shutdown()


def test_an_uninterruptible_stuck_worker_is_replaced(tokenizer, max_chars, monkeypatch):
    """A render blocked in C code ignores the interrupt; the pool works around it anyway,
    including for work that was already queued behind it."""
    release = threading.Event()
    real_render = tokenization.render

    def blocking_render(tok, messages, params, settings):
        if params.request_template == "block":
            release.wait()  # blocks in C: no bytecode runs, so no exception can land
        return real_render(tok, messages, RenderParams(), settings)

    monkeypatch.setattr(tokenization, "render", blocking_render)
    stage = make_stage(tokenizer, max_chars, threads=1, timeout=0.5)

    async def run():
        stuck = asyncio.create_task(stage.render_chat(HI, RenderParams(request_template="block")))
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(stage.tokenize("queued behind", TokenizeParams(
            max_total_tokens=64)))
        with pytest.raises(RenderTimeout):
            await stuck
        ids = (await asyncio.wait_for(queued, 5)).ids
        after = await asyncio.wait_for(stage.render_chat(HI, RenderParams()), 5)
        return ids, after

    try:
        ids, after = asyncio.run(run())
        assert ids == tokenizer.encode("queued behind")
        assert after.text.endswith("<|im_start|>assistant\n")
        assert live_workers() == ["tokenize-0", "tokenize-1"]  # the stuck one is still there
        release.set()
        assert wait_until(lambda: live_workers() == ["tokenize-1"]), live_workers()
    finally:
        release.set()
        stage.shutdown()



def test_render_timeout_counts_the_render_not_the_queue(tokenizer, max_chars, monkeypatch):
    """Under overload a request waits for a worker; that wait is not its template's fault.
    A render that starts late but runs fast succeeds; one that never gets a worker within
    the timeout is overload (RenderQueueTimeout, a 503), and never runs."""
    real_render = tokenization.render
    ran = []

    def slow_render(tok, messages, params, settings):
        ran.append(params.request_template)
        if params.request_template == "slow":
            time.sleep(0.4)  # within the 0.5 s timeout on its own
        return real_render(tok, messages, RenderParams(), settings)

    monkeypatch.setattr(tokenization, "render", slow_render)
    stage = make_stage(tokenizer, max_chars, threads=1, timeout=0.5)

    async def run():
        first = asyncio.create_task(stage.render_chat(HI, RenderParams(request_template="slow")))
        await asyncio.sleep(0.05)
        # Queued 0.35 s behind the first, then 0.4 s of its own: 0.75 s in all.
        second = asyncio.create_task(stage.render_chat(HI, RenderParams(
            request_template="slow")))
        await first
        return await second

    async def starved():
        blockers = [asyncio.create_task(stage.render_chat(HI, RenderParams(
            request_template="slow"))) for _ in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(tokenization.RenderQueueTimeout, match="overloaded"):
            await stage.render_chat(HI, RenderParams(request_template="starved"))
        await asyncio.gather(*blockers, return_exceptions=True)

    try:
        assert asyncio.run(run()).text.endswith("<|im_start|>assistant\n")
        asyncio.run(starved())
        assert "starved" not in ran  # cancelled while queued
    finally:
        stage.shutdown()
