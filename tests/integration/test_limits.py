"""Limits and security of a frontend (issue 9): API keys, CORS, body size, the queue cap and
the request timeout, against real processes. One engine that runs one sequence at a time (so
requests queue), a guarded frontend and a frontend with a short request timeout."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import openai
import pytest

from shared.transport import free_tcp_port
from tests.servers import Proc, metrics, start_frontend, wait_healthy, wait_until

pytestmark = pytest.mark.slow  # starts its own engine and frontends

KEYS = ("key-one", "key-two")
ORIGIN = "https://app.example"
MAX_BODY = 4096
TIMEOUT_S = 3


class Limited:
    def __init__(self, tmp_dir: str) -> None:
        address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.engine = Proc(["engine", "--engine-address", address, "--max-num-seqs", "1",
                            "--threads", "1"],
                           os.path.join(tmp_dir, "engine.log"))
        self.guarded, self.url = start_frontend(
            tmp_dir, address, "guarded", "--api-key", KEYS[0], "--api-key", KEYS[1],
            "--allowed-origins", ORIGIN, "--max-request-body-bytes", str(MAX_BODY),
            "--max-queued-requests", "2", "--export-engine-metrics")
        self.timed, self.timed_url = start_frontend(
            tmp_dir, address, "timed", "--request-timeout", str(TIMEOUT_S),
            "--export-engine-metrics")
        procs = [self.engine, self.guarded, self.timed]
        try:
            for url in (self.url, self.timed_url):
                wait_healthy(url, procs)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for p in (self.guarded, self.timed, self.engine):
            p.stop()


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    s = Limited(str(tmp_path_factory.mktemp("limits")))
    yield s
    s.stop()


AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
SHORT = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
LONG = {"prompt": "Count slowly to one thousand:", "max_tokens": 1000, "temperature": 0,
        "ignore_eos": True}


def _error_shape(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return body["error"]



def test_api_keys(limited):
    url = limited.url
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"},
                    {"Authorization": KEYS[0]}):  # a key without the Bearer scheme
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert _error_shape(r, 401)["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": KEYS[1]}).status_code == 200
    _error_shape(httpx.post(f"{url}/tokenize", json={"prompt": "hi"}), 401)
    # vLLM's ops routes: /v1/* and /invocations (it generates) need the key, probes do not.
    _error_shape(httpx.get(f"{url}/v1/models/SmolLM2-135M-Instruct"), 401)
    _error_shape(httpx.post(f"{url}/invocations", json={"prompt": "hi"}), 401)
    assert httpx.post(f"{url}/invocations", json=SHORT, headers=AUTH).status_code == 200
    for open_path in ("/health", "/ping", "/load", "/metrics", "/version", "/openapi.json"):
        assert httpx.get(f"{url}{open_path}").status_code == 200
    assert httpx.post(f"{url}/ping").status_code == 200
    # The official client sends the key as a bearer token.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[1], max_retries=0)
    done = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello",
                                     max_tokens=2, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert metrics(url)["sluice:requests_rejected_total"] >= 1


def test_cors(limited):
    url = limited.url
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    r = httpx.options(f"{url}/v1/chat/completions",
                      headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    # Plain responses carry the header too, a 401 included, so a browser can read it.
    r = httpx.get(f"{url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.get(f"{url}/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    # The frontend without --allowed-origins sends no CORS headers.
    r = httpx.get(f"{limited.timed_url}/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


def test_body_size(limited):
    url = limited.url
    big = {**SHORT, "prompt": "a" * MAX_BODY}
    error = _error_shape(httpx.post(f"{url}/v1/completions", json=big, headers=AUTH), 413)
    assert "--max-request-body-bytes" in error["message"]

    def chunks():  # chunked transfer: no Content-Length to judge by
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    r = httpx.post(f"{url}/v1/completions", content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"})
    _error_shape(r, 413)
    ok = httpx.post(f"{url}/v1/completions", json=SHORT, headers=AUTH, timeout=120)
    assert ok.status_code == 200, ok.text


def test_queue_cap_answers_503_with_retry_after(limited):
    url = limited.url
    out: dict = {}

    def long_stream():
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True},
                          headers=AUTH, timeout=300) as r:
            for _line in r.iter_lines():
                out["long_started"] = True
                if out.get("stop"):
                    return  # leaving closes the connection: the engine aborts it

    def short(i):
        out[i] = httpx.post(f"{url}/v1/completions", json=SHORT, headers=AUTH, timeout=300)

    runner = threading.Thread(target=long_stream)
    runner.start()
    try:
        wait_until(lambda: out.get("long_started"), 120, "the long stream")
        # The engine runs one sequence, so these two wait without a token: the queue is full.
        waiting = [threading.Thread(target=short, args=(i,)) for i in range(2)]
        for t in waiting:
            t.start()
        wait_until(lambda: metrics(url)["sluice:frontend_queued_requests"] == 2, 60, "two queued")
        r = httpx.post(f"{url}/v1/completions", json=SHORT, headers=AUTH, timeout=30)
        _error_shape(r, 503)
        assert r.headers["retry-after"] == "1"
    finally:
        out["stop"] = True
        runner.join(timeout=300)
    for t in waiting:
        t.join(timeout=300)
    assert [out[i].status_code for i in range(2)] == [200, 200]
    assert metrics(url)["sluice:frontend_queued_requests"] == 0
    ok = httpx.post(f"{url}/v1/completions", json=SHORT, headers=AUTH, timeout=120)
    assert ok.status_code == 200


def test_request_timeout_ends_and_aborts(limited):
    url = limited.timed_url
    before = metrics(url)
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True},
                      timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - started < TIMEOUT_S + 10
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 504 and "--request-timeout" in error["message"]
    r = httpx.post(f"{url}/v1/completions", json=LONG, timeout=120)
    _error_shape(r, 504)
    # Both were aborted in the engine, which holds no pages for them any more.
    wait_until(lambda: metrics(url)["sluice:requests_aborted_total"]
          == before["sluice:requests_aborted_total"] + 2, 30, "the aborts")
    now = metrics(url)
    assert now["sluice:kv_cache_free_pages"] == now["sluice:kv_cache_total_pages"]
    assert now["sluice:request_errors_total"] >= 2
