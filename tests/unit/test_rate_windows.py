"""Rate windows and a key's admission (`frontend.state.windows`, `window_stores`,
`frontend.http.key_limits`), on injected clocks: the sliding window's arithmetic, all-or-none
takes, settling, two SQLite stores sharing one budget, the concurrency cap under 32 requests
at once, and the store-outage policy."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from frontend.base.errors import APIError
from frontend.http.key_limits import KeyLimiter, Refusal, Shape, duration
from frontend.http.key_table import build_principals, parse_entries
from frontend.state.store import SqliteStore, StoreUnavailable
from frontend.state.window_stores import windows_for
from frontend.state.windows import Charge, MemoryWindows, Window, reset_s, retry_after_s

W = 60.0
T0 = 1_800_000_000.0 - 1_800_000_000.0 % W  # a window's start


def run(coro):
    return asyncio.run(coro)


def principal(**fields):
    text = msgspec.json.encode([{"name": "team-a", "key": "sk-team-a-0123456789", **fields}])
    return build_principals(parse_entries(text.decode()), [])[0]


@pytest.fixture(params=["memory", "sqlite"])
def windows(request, tmp_path):
    if request.param == "memory":
        yield MemoryWindows(W)
        return
    store = SqliteStore(str(tmp_path / "state.db"))
    yield windows_for(store)
    run(store.close())


def test_a_window_slides_by_the_previous_ones_weight(windows):
    async def go():
        three = [Charge("a:requests", 1, 3)]
        for _ in range(3):
            assert (await windows.take(three, T0 + 10)).admitted
        fourth = await windows.take(three, T0 + 10)
        assert fourth.refused == 0 and fourth.windows[0].remaining() == 0
        # Half through the next window half the last one still counts: 1.5 + 1 fits, 2.5 + 1 not.
        assert (await windows.take(three, T0 + W + 30)).admitted
        assert not (await windows.take(three, T0 + W + 30)).admitted
        # Two windows on, nothing of the first is left.
        late = await windows.take(three, T0 + 3 * W)
        assert late.admitted and late.windows[0].remaining() == 2
    run(go())


def test_a_take_charges_all_its_counters_or_none(windows):
    async def go():
        both = [Charge("a:requests", 1, 10), Charge("a:tokens", 600, 1000)]
        assert (await windows.take(both, T0)).admitted
        refused = await windows.take(both, T0 + 1)
        assert refused.refused == 1  # the tokens did not fit ...
        # ... so that request was not counted either.
        again = await windows.take([Charge("a:requests", 1, 10)], T0 + 2)
        assert again.windows[0].curr == 2
        await windows.adjust("a:tokens", again.windows[0].index, -500)  # settled: used 100
        assert (await windows.take(both, T0 + 3)).windows[1].curr == 700
        await windows.adjust("a:tokens", again.windows[0].index, -10_000)  # never below 0
        assert (await windows.take([Charge("a:tokens", 0, 1000)], T0 + 4)).windows[0].curr == 0
    run(go())


def test_two_sqlite_stores_on_one_file_share_the_budget(tmp_path):
    async def go():
        stores = [SqliteStore(str(tmp_path / "state.db")) for _ in range(2)]
        a, b = (windows_for(s) for s in stores)
        assert a.shared and not MemoryWindows().shared
        three = [Charge("k:requests", 1, 3)]
        for w in (a, b, a):
            assert (await w.take(three, T0)).admitted
        assert not (await b.take(three, T0)).admitted
        for s in stores:
            await s.close()
    run(go())


def test_retry_after_and_reset_follow_the_slide():
    full = Window(limit=3, prev=0, curr=3, index=0, fraction=0.5)
    # One more fits a third into the next window (3 × (1 − h) + 1 ≤ 3).
    assert retry_after_s(full, 1, W) == pytest.approx(30 + 20)
    assert reset_s(full, W) == pytest.approx(90)
    sliding = Window(limit=3, prev=3, curr=1, index=1, fraction=0.25)
    assert retry_after_s(sliding, 1, W) == pytest.approx((2 / 3 - 0.25) * W)
    assert reset_s(sliding, W) == pytest.approx(45 + 60)
    assert reset_s(Window(3, 2, 0, 1, 0.5), W) == pytest.approx(30)
    assert reset_s(Window(3, 0, 0, 1, 0.5), W) == 0
    assert retry_after_s(full, 4, W) == W  # more than the limit: never; a whole window
    assert [duration(s) for s in (0.0123, 0.9999, 1, 59.2, 60, 90.5, 3600)] == \
        ["13ms", "1000ms", "1s", "1m0s", "1m0s", "1m31s", "60m0s"]


class Failing(MemoryWindows):
    async def take(self, charges, now):
        raise StoreUnavailable("redis: connection refused")


def test_a_store_outage_follows_the_policy():
    key = principal(requests_per_minute=1, max_concurrent=1)

    async def go():
        opened = KeyLimiter(Failing(), "m", fail_open=True, clock=lambda: T0)
        admitted = await opened.admit(key, "/v1/completions", b'{"prompt": "x"}', None)
        assert admitted.headers == {} and admitted.index is None
        await opened.settle(admitted, 3, 2)
        closed = KeyLimiter(Failing(), "m", fail_open=False, clock=lambda: T0)
        with pytest.raises(Refusal) as info:
            await closed.admit(key, "/v1/completions", b'{"prompt": "x"}', None)
        assert info.value.status == 503 and info.value.headers == {"Retry-After": "1"}
        assert closed.in_flight["team-a"] == 0  # the refused request holds no slot
    run(go())


def test_the_concurrency_cap_holds_under_32_at_once():
    key = principal(max_concurrent=2)
    limiter = KeyLimiter(MemoryWindows(), "m", clock=lambda: T0)
    gate = asyncio.Event()
    seen = {"most": 0, "admitted": 0, "refused": 0}

    async def one():
        try:
            admitted = await limiter.admit(key, "/v1/completions", b"{}", Shape())
        except Refusal as refusal:
            assert refusal.status == 429 and refusal.code == "max_concurrent"
            seen["refused"] += 1
            return
        seen["admitted"] += 1
        seen["most"] = max(seen["most"], limiter.in_flight["team-a"])
        await gate.wait()
        await limiter.settle(admitted, 1, 1)

    async def go():
        tasks = [asyncio.create_task(one()) for _ in range(32)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(*tasks)
        assert seen == {"most": 2, "admitted": 2, "refused": 30}
        assert limiter.in_flight["team-a"] == 0
        await limiter.settle(await limiter.admit(key, "/v1/completions", b"{}", Shape()), 0, 0)
    run(go())


def test_models_max_tokens_and_the_reservation():
    key = principal(models=["adapter-a"], max_tokens_per_request=8, tokens_per_minute=100)
    limiter = KeyLimiter(MemoryWindows(), "base", clock=lambda: T0)

    async def go():
        with pytest.raises(Refusal) as info:  # no model: the served one, not in the list
            await limiter.admit(key, "/v1/chat/completions", b"{}", Shape())
        assert info.value.status == 404 and info.value.code == "model_not_found"
        with pytest.raises(Refusal):
            await limiter.admit(key, "/v1/models/base", None, None)
        with pytest.raises(APIError) as info:
            await limiter.admit(key, "/v1/completions", b"{}",
                                Shape(model="adapter-a", max_tokens=9))
        assert info.value.status == 400 and info.value.param == "max_tokens"
        body = b'{"model": "adapter-a", "messages": []}'
        admitted = await limiter.admit(key, "/v1/chat/completions", body,
                                       Shape(model="adapter-a", n=2))
        # Left out, max tokens is the key's cap, written into the body the route reads.
        assert msgspec.json.decode(admitted.body)["max_completion_tokens"] == 8
        assert admitted.reserved == -(-len(body) // 4) + 8 * 2
        assert admitted.headers["x-ratelimit-remaining-tokens"] == str(100 - admitted.reserved)
        await limiter.settle(admitted, 5, 3)  # used 8 in all
        listed = await limiter.admit(key, "/v1/batches", b'{"input_file_id": "f"}', Shape())
        assert listed.reserved == 0  # what runs no model spends no tokens
        assert listed.headers["x-ratelimit-remaining-tokens"] == str(100 - 8)
        await limiter.settle(listed, 0, 0)
        with pytest.raises(Refusal) as info:  # more than a minute's tokens: never fits
            await limiter.admit(key, "/v1/completions", b'{"prompt": "%s"}' % (b"x" * 400),
                                Shape(model="adapter-a"))
        assert info.value.code == "tokens_per_minute" and "more than" in info.value.message
    run(go())


def test_a_batch_line_waits_for_the_budget_and_leaves_interactive_room():
    """admit_idle on an injected clock whose sleep moves it: a line takes at most 80% of a
    limit, waits (never refused) while that is used, and interactive requests still fit."""
    key = principal(requests_per_minute=10, max_concurrent=1)
    now = [T0]

    async def sleep(seconds):
        now[0] += seconds

    limiter = KeyLimiter(MemoryWindows(), "m", clock=lambda: now[0], sleep=sleep)

    async def go():
        for _ in range(8):  # the lines' share: 8 of 10
            line = await limiter.admit_idle(key, "/v1/completions", b"{}", Shape())
            assert not line.slot and now[0] == T0
            await limiter.settle(line, 1, 1)
        # The ninth waits, time passing, until enough of the window slid out ...
        ninth = await limiter.admit_idle(key, "/v1/completions", b"{}", Shape())
        assert now[0] > T0 + W
        await limiter.settle(ninth, 0, 0)
        # ... while an interactive request had room all along, and holds its slot as usual.
        now[0] = T0 + 1
        fresh = KeyLimiter(MemoryWindows(), "m", clock=lambda: now[0], sleep=sleep)
        for _ in range(8):
            await fresh.settle(await fresh.admit_idle(key, "/v1/completions", b"{}",
                                                      Shape()), 0, 0)
        admitted = await fresh.admit(key, "/v1/completions", b"{}", Shape())
        assert admitted.headers["x-ratelimit-remaining-requests"] == "1"
        with pytest.raises(Refusal):  # the slot is taken: max_concurrent 1
            await fresh.admit(key, "/v1/completions", b"{}", Shape())
        await fresh.settle(admitted, 0, 0)
        big = principal(tokens_per_minute=100)
        with pytest.raises(Refusal, match="batch line"):  # 81+ tokens: never within 80
            await fresh.admit_idle(big, "/v1/completions", b'{"prompt": "%s"}' % (b"x" * 320),
                                   Shape())
    run(go())


def test_a_batch_line_runs_within_its_owners_limits():
    from frontend.http.key_setup import KeyService, batch_line
    from frontend.http.key_table import KeyTable

    table = KeyTable(None, [])
    table.principals = [principal(models=["adapter-a"], max_tokens_per_request=8)]
    keys = KeyService(table, KeyLimiter(MemoryWindows(), "base", clock=lambda: T0))
    ran = []

    async def route(body):
        ran.append(msgspec.json.decode(body))
        return 200, b"{}"

    async def go():
        owner = table.principals[0].owner
        status, body = await batch_line(keys, owner, "/v1/chat/completions",
                                        b'{"model": "base", "messages": []}', route)
        assert status == 404 and not ran
        assert msgspec.json.decode(body)["error"]["code"] == "model_not_found"
        line = b'{"model": "adapter-a", "messages": []}'
        assert await batch_line(keys, owner, "/v1/chat/completions", line, route) == (200, b"{}")
        assert ran[-1]["max_completion_tokens"] == 8
        # A batch of nobody the table knows (no keys, or an --api-key) runs as it is.
        assert await batch_line(keys, "0" * 32, "/v1/chat/completions", line, route) == \
            (200, b"{}")
        assert "max_completion_tokens" not in ran[-1]
    run(go())
