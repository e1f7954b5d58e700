"""The serving spine end to end: real engine and frontend processes, real model, real sockets."""

import json
import threading
import time

import httpx
import openai
import pytest

from tests.servers import metrics

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_chat_answers_paris(base_url):
    r = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": "SmolLM2-135M-Instruct", "messages": PARIS, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_openai_client_chat_and_completion(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=PARIS, temperature=0, max_tokens=20
    )
    assert "Paris" in chat.choices[0].message.content
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=PARIS, temperature=0, max_tokens=20, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    done = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=5,
        temperature=0,
    )
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 5


def test_stream_shape(base_url):
    body = {
        "messages": PARIS, "temperature": 0, "max_tokens": 12, "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant"}  # role only: content omitted, not ""
    choice_chunks = [c for c in chunks if c["choices"]]
    finishes = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] in ("stop", "length")
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] >= 1


def test_completion_default_max_tokens_is_16(base_url):
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16


def test_seeded_sampling_is_reproducible(base_url):
    body = {"prompt": "My favourite colour is", "temperature": 1.0, "seed": 1234,
            "max_tokens": 12, "ignore_eos": True}
    texts = {
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        for _ in range(2)
    }
    assert len(texts) == 1


def test_stop_token_ids_stop_in_engine(base_url):
    from shared.model_source import default_model_path
    from shared.tokenizer import load_tokenizer

    prompt = "The capital of France is"
    client = httpx.Client(base_url=base_url, timeout=60)
    first = client.post("/v1/completions", json={
        "prompt": prompt, "temperature": 0, "max_tokens": 1,
    }).json()["choices"][0]["text"]
    (first_id,) = load_tokenizer(default_model_path()).encode(first, add_special_tokens=False)
    r = client.post("/v1/completions", json={
        "prompt": prompt, "temperature": 0, "max_tokens": 10, "stop_token_ids": [first_id],
    }).json()
    choice = r["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", first_id)
    assert r["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": PARIS, "temprature": 0}, 400, "temprature"),
        ({"messages": PARIS, "model": "gpt-4o"}, 404, "model"),
        ({"messages": PARIS, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"messages": PARIS, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": PARIS, "max_tokens": 100000}, 400, "max_tokens"),
        ({"messages": PARIS, "top_p": 0}, 400, "top_p"),
        ({"messages": PARIS, "n": 0}, 400, "n"),
        ({"messages": "hello"}, 400, None),
    ],
)
def test_bad_requests_get_clear_errors(base_url, body, status, param):
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param


def test_not_json_is_400(base_url):
    r = httpx.post(f"{base_url}/v1/completions", content=b"{nope", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def _stream_until_done(base_url, body, record, name, stop=None):
    """Streams until [DONE] (then records `name`) or until `stop` is set (then it leaves,
    closing the connection: the engine aborts the request)."""
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as r:
        for event in sse_events(r):
            record.setdefault(name + "_first", time.monotonic())
            if event == "[DONE]":
                record[name] = time.monotonic()
                return
            if stop is not None and stop.is_set():
                return


def test_continuous_batching(base_url):
    """A short request sent while a long one streams joins the batch and finishes first.
    The long one is then dropped: its remaining tokens would only cost time."""
    record: dict[str, float] = {}
    stop = threading.Event()
    long_body = {"prompt": "Write a long story about a dragon.", "max_tokens": 200,
                 "temperature": 0, "ignore_eos": True, "stream": True}
    long_thread = threading.Thread(target=_stream_until_done,
                                   args=(base_url, long_body, record, "long", stop))
    long_thread.start()
    deadline = time.monotonic() + 60
    while "long_first" not in record and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "long_first" in record
    short_body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base_url}/v1/completions", json=short_body, timeout=300)
    assert r.status_code == 200
    assert "long" not in record  # the long one still streams
    stop.set()
    long_thread.join(timeout=300)
    assert metrics(base_url)["sluice:max_seqs_in_step"] >= 2
    # The dropped stream's abort is through before the next test counts aborts.
    deadline = time.monotonic() + 30
    while metrics(base_url)["sluice:num_requests_running"] > 0:
        assert time.monotonic() < deadline, "the dropped stream was never aborted"
        time.sleep(0.2)


def test_disconnect_aborts_and_returns_every_page(base_url):
    before = metrics(base_url)
    body = {"prompt": "Count to one thousand:", "max_tokens": 500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(sse_events(r)):
            if i == 3:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = metrics(base_url)
        if (now["sluice:requests_aborted_total"] > before["sluice:requests_aborted_total"]
                and now["sluice:kv_cache_free_pages"] == now["sluice:kv_cache_total_pages"]):
            break
        time.sleep(0.3)
    assert now["sluice:requests_aborted_total"] == before["sluice:requests_aborted_total"] + 1
    assert now["sluice:kv_cache_free_pages"] == now["sluice:kv_cache_total_pages"]
    assert now["sluice:num_requests_running"] == 0


def test_health_version_models(base_url):
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert httpx.get(f"{base_url}/version").json()["version"]
    card = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert card["id"] == "SmolLM2-135M-Instruct" and card["max_model_len"] == 8192


def test_sluice_bench_against_the_stack(base_url):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "--base-url", f"{base_url}/v1",
         "--concurrency", "2", "--num-requests", "4", "--max-tokens", "8", "--ignore-eos",
         "--warmup", "0", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout)
    assert (result["completed"], result["errors"]) == (4, 0)
    assert result["output_tokens"] == 32  # exact: counted from the usage chunks
    assert result["ttft_p50_ms"] > 0 and result["output_tokens_per_s"] > 0


def test_tools_with_tool_choice_none_are_served(base_url):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    body = {"messages": PARIS, "temperature": 0, "max_tokens": 8, "tools": tools}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = httpx.post(f"{base_url}/v1/chat/completions",
                   json={**body, "tool_choice": "none"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
