"""vLLM's operational routes (issue 19 item 5): /v1/models/{id}, /ping, /load, /invocations
and the X-Request-Id header, over real HTTP and the official client, on the session stack.
Their place behind --api-key is in test_limits (the guarded frontend)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.servers import wait_until

MODEL = "SmolLM2-135M-Instruct"
SHORT = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def test_models_retrieve(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump()["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    error = raised.value.body
    assert error["type"] == "not_found_error" and "no-such-model" in error["message"]
    # A Hub-style id with a slash is one id (404 here, not Starlette's route-level 404).
    r = httpx.get(f"{base_url}/v1/models/org/name")
    assert r.status_code == 404 and "'org/name'" in r.json()["error"]["message"]


def test_ping_is_health(http):
    assert http.get("/ping").status_code == 200
    assert http.post("/ping").status_code == 200
    assert http.post("/ping", content=b"anything").status_code == 200


def test_load_counts_requests_in_flight(http, base_url):
    # The stack is shared: requests earlier tests left (clients that went away) end first.
    wait_until(lambda: http.get("/load").json() == {"server_load": 0}, 30, "an idle server")
    body = {"model": MODEL, "prompt": "Count to a hundred:", "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream (client gone)
        next(lines)  # the request is running
        assert http.get("/load").json() == {"server_load": 1}
    # The client left: the request ends (its abort takes a moment). Probes are not load.
    wait_until(lambda: http.get("/load").json()["server_load"] == 0, 30, "the load to drop")
    http.get("/health")
    assert http.get("/load").json()["server_load"] == 0


def test_invocations_route_by_body_shape(http):
    chat = http.post("/invocations", json={
        "messages": [{"role": "user", "content": "Hi"}], **SHORT})
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion"
    done = http.post("/invocations", json={"prompt": "Hello", **SHORT})
    assert done.status_code == 200, done.text
    assert done.json()["object"] == "text_completion"
    assert done.json()["usage"]["completion_tokens"] == 2
    # Streams too, as the route it lands on.
    with http.stream("POST", "/invocations", json={"prompt": "Hello", "stream": True,
                                                   **SHORT}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    # Neither shape: a 400 in OpenAI's error shape; a bad chat body: chat's own 400.
    nothing = http.post("/invocations", json={"input": "embed me"})
    assert nothing.status_code == 400
    assert nothing.json()["error"]["type"] == "invalid_request_error"
    typo = http.post("/invocations", json={"messages": [], "temprature": 1})
    assert typo.status_code == 400 and typo.json()["error"]["param"] == "temprature"
    assert http.post("/invocations", content=b"[1, 2]").status_code == 400


def test_x_request_id_is_the_request_id_and_is_echoed(http, base_url):
    headers = {"X-Request-Id": "trace-abc-123"}
    r = http.post("/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "user", "content": "Hi"}], **SHORT})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-abc-123"
    assert r.json()["id"] == "chatcmpl-trace-abc-123"
    # Over the body's request_id, as vLLM; streams and errors echo it too.
    with http.stream("POST", "/v1/completions", headers=headers, json={
            "prompt": "Hi", "request_id": "body-id", "stream": True, **SHORT}) as s:
        assert s.headers["x-request-id"] == "trace-abc-123"
        first = json.loads(next(line for line in s.iter_lines()
                                if line.startswith("data: "))[6:])
    assert first["id"] == "cmpl-trace-abc-123"
    bad = http.post("/v1/completions", headers=headers, json={"prompt": "Hi", "n": 0})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "trace-abc-123"
    # Without the header: none is invented.
    assert "x-request-id" not in http.get("/v1/models").headers
    # The official client's per-request headers.
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "from-client"})
    assert raw.headers["x-request-id"] == "from-client"
    assert raw.parse().id == "cmpl-from-client"
    # The Messages API, whose body has no request_id, takes it from the header too.
    message = http.post("/v1/messages", headers=headers, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert message.status_code == 200, message.text
    assert message.json()["id"] == "msg_trace-abc-123"
    assert message.headers["x-request-id"] == "trace-abc-123"
