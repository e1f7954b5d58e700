"""Issue 50's JSON logs and introspection on one `sluice serve` stack: two engines
(`--data-parallel-size 2`), a postproc worker and the frontend, all with `--log-format
json` and an API key. `GET /v1/engines`: its shape and boundaries, a request in flight on
its engine, an engine frozen past the heartbeat shown "down" with the request moved off it,
then "up" again. Then, with the stack stopped, every line every process wrote parses as
JSON, and each request has one access line carrying its id."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.servers import Stack, wait_until

pytestmark = pytest.mark.slow  # its own serve stack: two engines load the model

KEY = "sk-observe"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(str(tmp_path_factory.mktemp("observe")), "--data-parallel-size", "2",
              "--postproc-workers", "1", "--log-format", "json", "--api-key", KEY)
    try:
        wait_until(lambda: [(e["state"], e["postproc_workers"]) for e in _engines(s)]
                   == [("up", 1), ("up", 1)], 60, "both engines up, the worker on both")
        yield s
    finally:
        s.stop()


def _engines(stack) -> list[dict]:
    answer = httpx.get(f"{stack.base_url}/v1/engines", headers=AUTH, timeout=10)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "list"
    return body["data"]


def _engine_pid(stack, engine_id: str) -> int:
    """The pid of the engine serve started as `--engine-id engine_id`."""
    serve = stack.proc.popen.pid
    with open(f"/proc/{serve}/task/{serve}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"engine" in argv and engine_id.encode() in argv:
            return pid
    raise AssertionError(f"no engine {engine_id} among serve's children {children}")


def _chat(stack, request_id: str, **body) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60,
                      headers={**AUTH, "X-Request-Id": request_id},
                      json={"messages": [{"role": "user", "content": "Count to twenty."}],
                            **body})


def test_engines_route_lists_both_engines_behind_the_key(stack):
    assert httpx.get(f"{stack.base_url}/v1/engines").status_code == 401
    assert httpx.get(f"{stack.base_url}/v1/engines",
                     headers={"Authorization": "Bearer wrong"}).status_code == 401
    refused = httpx.post(f"{stack.base_url}/v1/engines", headers=AUTH)
    assert refused.status_code == 405 and refused.json()["error"]["code"] == 405
    engines = _engines(stack)
    assert [e["address"] for e in engines] == sorted(e["address"] for e in engines)
    assert {e["id"] for e in engines} == {"engine-0", "engine-1"}
    for e in engines:
        assert set(e) == {"id", "address", "role", "state", "running", "waiting",
                          "kv_pages_total", "kv_pages_free", "kv_pages_used", "page_size",
                          "prefix_cache_hit_rate", "loras", "postproc_workers", "migrated_in",
                          "migrated_out", "preemptions", "requests"}
        assert e["address"].startswith("ipc://") and e["role"] == "both"
        assert e["kv_pages_total"] > 0 and e["page_size"] == 16
        assert e["kv_pages_used"] == e["kv_pages_total"] - e["kv_pages_free"]
        assert e["loras"] == [] and e["requests"] == [] and e["postproc_workers"] == 1
        assert e["migrated_in"] == e["migrated_out"] == e["preemptions"] == 0
        assert e["prefix_cache_hit_rate"] is None or 0 <= e["prefix_cache_hit_rate"] <= 1
    spec = httpx.get(f"{stack.base_url}/openapi.json").json()
    assert "get" in spec["paths"]["/v1/engines"]


def test_a_request_in_flight_then_its_engine_frozen_shows_down_and_moved(stack):
    done = threading.Event()
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body,
                          headers={**AUTH, "X-Request-Id": "long-1"}, timeout=120) as answer:
            for _ in answer.iter_lines():
                first_chunk.set()
                if done.is_set():
                    return  # closing the stream aborts the request

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    frozen = None
    try:
        assert first_chunk.wait(60)
        wait_until(lambda: any(e["requests"] for e in _engines(stack)), 20,
                   "the request listed on its engine")
        home = next(e for e in _engines(stack) if e["requests"])
        [request] = home["requests"]
        assert request["id"] == "chatcmpl-long-1" and request["age_s"] > 0
        assert request["output_tokens"] >= 0
        frozen = _engine_pid(stack, home["id"])
        os.kill(frozen, signal.SIGSTOP)  # silent, socket up: down once the heartbeat lapses

        def moved() -> bool:
            by_id = {e["id"]: e for e in _engines(stack)}
            other = next(e for i, e in by_id.items() if i != home["id"])
            return (by_id[home["id"]]["state"] == "down"
                    and [r["id"] for r in other["requests"]] == ["chatcmpl-long-1"])

        wait_until(moved, 20, "the frozen engine down, its request on the other")
        by_id = {e["id"]: e for e in _engines(stack)}
        assert by_id[home["id"]]["migrated_out"] == 1 and by_id[home["id"]]["requests"] == []
        other = next(e for i, e in by_id.items() if i != home["id"])
        assert other["migrated_in"] == 1 and other["migrated_out"] == 0
    finally:
        done.set()
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
    wait_until(lambda: [e["state"] for e in _engines(stack)] == ["up", "up"], 30,
               "the woken engine up again")
    client.join(30)


def test_every_line_of_every_process_is_json_with_one_access_line_per_request(stack):
    streamed = _chat(stack, "log-stream", max_tokens=8, stream=True)
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    bad = _chat(stack, "log-bad", max_tokens=-1)
    assert bad.status_code == 400
    assert _chat(stack, "log-plain", max_tokens=4).status_code == 200
    assert httpx.get(f"{stack.base_url}/v1/models").status_code == 401  # no key, no id sent
    stack.stop()  # the shutdown lines too
    lines = [json.loads(line) for line in stack.proc.log().splitlines()]  # each must parse
    assert {line["role"] for line in lines} == {"serve", "frontend", "engine", "postproc"}
    for line in lines:
        assert {"timestamp", "level", "logger", "message", "role"} <= set(line), line
        if line["role"] == "engine":
            assert line["engine_id"] in ("engine-0", "engine-1"), line
    access = [line for line in lines if line["logger"] == "uvicorn.access"]
    for request_id, status in [("chatcmpl-log-stream", 200), ("log-bad", 400),
                               ("chatcmpl-log-plain", 200)]:
        [mine] = [a for a in access if a.get("request_id") == request_id]
        assert (mine["method"], mine["path"], mine["status"]) == (
            "POST", "/v1/chat/completions", status)
    refused = [a for a in access if a["path"] == "/v1/models" and a["status"] == 401]
    assert len(refused) == 1 and len(refused[0]["request_id"]) == 32  # one made up for it
    assert any(line["level"] == "ERROR" and line.get("engine_id") for line in lines
               if line["role"] == "frontend")  # the frozen engine, named in its own field
