"""OpenAI protocol fidelity, end to end (req R-1, R-3, P-1 to P-12, O-1 to O-4, O-7).

Real processes and the real default model, spoken to with the official `openai` client and
with raw httpx. Each test names the requirements it proves; each would fail without the
behaviour. Generation is kept to a few tokens and independent requests run concurrently (the
engine batches them), so the file stays cheap on a small CPU machine.
"""

from __future__ import annotations

import base64
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from shared.transport import free_tcp_port
from tests.servers import Proc

MODEL = "SmolLM2-135M-Instruct"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
YES = [{"role": "user", "content": "Say only the word yes."}]  # greedy: "Yes." then EOS
FRANCE = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 201..."
APPLES = "apple, apple, apple, apple, apple, apple,"  # greedy: " apple"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def complete(http, **body) -> dict:
    return ok(http.post("/v1/completions", json=body))


def chat(http, **body) -> dict:
    return ok(http.post("/v1/chat/completions", json=body))


def stream(http, path: str, body: dict) -> list[dict]:
    """An SSE stream's JSON events; asserts it ends with [DONE] and nothing after."""
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def streamed_text(events: list[dict], index: int = 0) -> str:
    parts = []
    for e in events:
        for c in e["choices"]:
            if c["index"] == index:
                parts.append(c["text"] if "text" in c else c["delta"].get("content") or "")
    return "".join(parts)


def parallel(fn, *calls):
    """Runs fn(*args) for each args tuple at once; results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda args: fn(*args), calls))


def assert_error(response: httpx.Response, status: int, param="any") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if param != "any":
        assert error["param"] == param, error
    return error


def token_id(http, text: str) -> int:
    (tid,) = ok(http.post("/tokenize", json={"prompt": text}))["tokens"]
    return tid


# ---------------------------------------------------------------- R-1 routes


def test_routes_answer(http):
    """R-1: every route exists and answers in its format."""
    assert http.get("/health").status_code == 200
    assert ok(http.get("/version"))["version"]
    models = ok(http.get("/v1/models"))
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and "sluice:" in metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")


def test_tokenize_and_detokenize_round_trip(http):
    """R-1: /tokenize and /detokenize (vLLM bodies); messages are rendered exactly as chat
    renders them, so the count equals a chat request's prompt_tokens."""
    text = "Hello world, how are you?"
    body = ok(http.post("/tokenize", json={"model": MODEL, "prompt": text}))
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}  # vLLM's body
    assert body["token_strs"] is None  # only with return_token_strs
    assert body["count"] == len(body["tokens"]) > 1
    assert body["max_model_len"] == ok(http.get("/v1/models"))["data"][0]["max_model_len"]
    assert ok(http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})) == {
        "prompt": text
    }
    rendered = ok(http.post("/tokenize", json={"messages": PARIS}))
    usage = chat(http, messages=PARIS, max_tokens=1)["usage"]
    assert rendered["count"] == usage["prompt_tokens"]
    bare = ok(http.post("/tokenize", json={"messages": PARIS, "add_generation_prompt": False}))
    assert bare["count"] < rendered["count"]
    assert rendered["tokens"][: bare["count"]] == bare["tokens"]
    # The chat template's BOS survives detokenization (special tokens are kept, as vLLM).
    assert "<|im_start|>" in ok(http.post("/detokenize", json={"tokens": rendered["tokens"]}))[
        "prompt"
    ]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": PARIS}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_token": True}, 400, "add_special_token"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_tokenize_errors(http, path, body, status, param):
    """R-1, R-3: the tokenizer routes fail in the one error shape."""
    assert_error(http.post(path, json=body), status, param)


# ---------------------------------------------------------------- R-3 errors


@pytest.mark.parametrize("method, path, body, status, param", [
    ("POST", "/v1/chat/completions", {"messages": PARIS, "model": "gpt-4o"}, 404, "model"),
    ("POST", "/v1/completions", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"messages": PARIS, "temprature": 0}, 400, "temprature"),
    ("POST", "/v1/completions", {"prompt": "a", "max_token": 3}, 400, "max_token"),
    ("POST", "/v1/chat/completions", {"messages": PARIS, "n": "two"}, 400, "n"),
    ("POST", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "contnet": "x"}]}, 400,
     "messages[0].contnet"),
    ("POST", "/v1/chat/completions",
     {"messages": PARIS, "stream": True, "stream_options": {"include_usge": True}}, 400,
     "stream_options.include_usge"),
    ("POST", "/v1/completions", b"{not json", 400, None),
    ("POST", "/v1/completions", b"", 400, None),
    ("GET", "/v1/nope", None, 404, None),
    ("GET", "/v1/chat/completions", None, 405, None),
    ("DELETE", "/tokenize", None, 405, None),
])
def test_every_error_has_the_one_shape(http, method, path, body, status, param):
    """R-3: request problems 400 naming the field, unknown model or path 404, wrong method 405,
    all as {"error": {message, type, param, code}}."""
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = http.request(method, path, **(kwargs if body is not None else {}))
    error = assert_error(response, status, param)
    if status == 404 and param == "model":
        assert "gpt-4o" in error["message"]


def test_official_client_gets_typed_errors(client):
    """R-3: the statuses map to the official client's exception classes (400 is not retried)."""
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=PARIS, extra_body={"topk": 5})
    assert bad.value.status_code == 400 and "topk" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="davinci-002", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="a", logprobs=21, max_tokens=1)


def test_request_id_already_running_is_refused_without_harm(http):
    """R-3 (and a product fix): a second request reusing a running request_id is a 400; the
    first one is not disturbed. 48 tokens: the first must still run when the second comes
    (6 ended first on a fast machine)."""
    body = {"prompt": FRANCE, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "request_id": f"dup-{time.monotonic_ns()}"}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as first:
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it is running now
        assert_error(http.post("/v1/completions", json=body), 400, "request_id")
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"


def test_no_engine_means_503(tmp_path):
    """R-1, R-3: a frontend whose engine is gone says /health 503 and answers requests with a
    503 in the error shape (clients retry those), streaming or not."""
    port = free_tcp_port()
    dead = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = Proc(["frontend", "--engine-address", dead, "--port", str(port)],
                os.path.join(tmp_path, "frontend.log"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.popen.poll() is None, proc.log()[-3000:]
            try:
                health = httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, proc.log()[-3000:]
                time.sleep(0.3)
        assert health.status_code == 503
        for body in ({"messages": PARIS}, {"messages": PARIS, "stream": True}):
            assert_error(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30), 503)
        assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, timeout=30), 503)
        with pytest.raises(openai.InternalServerError) as info:
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt="a")
        assert info.value.status_code == 503
    finally:
        proc.stop()


# ---------------------------------------------------------------- P-1 known fields


def test_official_client_may_send_every_openai_field(client):
    """P-1, P-2: fields the server ignores or honours never cost the official client a 400."""
    done = client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=1, max_completion_tokens=1, temperature=0,
        top_p=1, n=1, stop=["\n\n"], seed=1, presence_penalty=0, frequency_penalty=0,
        logit_bias={}, logprobs=False, user="u-1", store=False, metadata={"team": "a"},
        service_tier="auto", prompt_cache_key="k", safety_identifier="s",
        reasoning_effort="low", verbosity="low", modalities=["text"],
        parallel_tool_calls=True, tool_choice="none", response_format={"type": "text"},
        prediction={"type": "content", "content": "Paris"}, prompt_cache_retention="24h",
        prompt_cache_options={"mode": "implicit"},
    )
    assert done.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=1, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": True},
    ))
    assert chunks[-1].usage.completion_tokens == 1
    legacy = client.completions.create(
        model=MODEL, prompt="a", max_tokens=1, best_of=1, echo=False, user="u", n=1, seed=3,
        logit_bias={}, stream=False,
    )
    assert legacy.usage.completion_tokens == 1


def test_null_means_default(http):
    """P-1: OpenAI fields are nullable; clients send null for "not set"."""
    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None,
             "temperature": None, "top_p": None, "seed": None, "stop": None, "logprobs": None,
             "logit_bias": None, "user": None, "stream_options": None, "max_tokens": 1}
    body = chat(http, messages=PARIS, top_logprobs=None, max_completion_tokens=None,
                tools=None, tool_choice=None, response_format=None, **nulls)
    assert len(body["choices"]) == 1
    body = complete(http, prompt="a", echo=None, best_of=None, suffix=None, **nulls)
    assert len(body["choices"]) == 1
    # The vLLM extensions too, on the faces that translate into a chat request.
    extensions = {f: None for f in ("ignore_eos", "min_tokens", "priority", "seed", "top_k",
                                    "min_p", "repetition_penalty", "continue_final_message",
                                    "presence_penalty", "frequency_penalty", "stop",
                                    "stream", "store", "temperature", "top_p")}
    body = ok(http.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                               "max_output_tokens": 1, **extensions}))
    assert body["object"] == "response" and body["store"] is True  # null store: stored
    body = ok(http.post("/v1/messages", json={
        "model": MODEL, "max_tokens": 1, "messages": PARIS, "stream": None, "top_k": None,
        "temperature": None, "top_p": None, "stop_sequences": None, "system": None,
        "thinking": None, "tools": None, "tool_choice": None, "metadata": None}))
    assert body["type"] == "message"  # a null stream is a whole answer, not events


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ("/v1/completions", {"suffix": "!"}, "suffix"),
])
def test_known_but_unsupported_fields_are_a_400_naming_them(http, path, extra, param):
    """P-1, P-6: a known field we cannot honour, set to a non-default value, is a 400 that
    says it is unsupported, never silently ignored. (Structured outputs, P-8, are served:
    tests/integration/test_structured_output.py.)"""
    base = {"messages": PARIS} if "chat" in path else {"prompt": "a"}
    error = assert_error(http.post(path, json={**base, **extra}), 400, param)
    assert "not supported" in error["message"]


def test_tools_without_a_tool_call_parser_say_what_is_missing(http):
    """C-3: tools the model may call need a parser to read the calls back; this server has
    none, so the 400 names the flag (tool_choice "none" stays fine: the template sees them)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "f"}}):
        body = {"messages": PARIS, "tools": tools, "tool_choice": choice, "max_tokens": 1}
        error = assert_error(http.post("/v1/chat/completions", json=body), 400)
        assert error["param"] in ("tools", "tool_choice") and "--tool-call-parser" in (
            error["message"])
    ok(http.post("/v1/chat/completions",
                 json={"messages": PARIS, "tools": tools, "tool_choice": "none",
                       "max_tokens": 1}))


# ---------------------------------------------------------------- P-4 defaults, P-5 lengths


def test_defaults_are_pinned(http):
    """P-4: a missing temperature or top_p means 1.0 (not greedy, not an engine default)."""
    body = {"prompt": "My favourite animal is the", "max_tokens": 6, "seed": 7,
            "ignore_eos": True}
    implicit, explicit, other_seed = parallel(
        lambda b: complete(http, **b)["choices"][0]["text"],
        (body,), ({**body, "temperature": 1.0, "top_p": 1.0},), ({**body, "seed": 8},),
    )
    assert implicit == explicit
    assert implicit != other_seed  # it really samples


def test_completions_default_to_16_tokens(http):
    """P-5: completions default max_tokens is 16."""
    usage = complete(http, prompt="Once upon a time", temperature=0, ignore_eos=True)["usage"]
    assert usage["completion_tokens"] == 16


def test_prompt_without_room_is_a_400(http):
    """P-5: a prompt that fills the context is a 400, never a zero-token answer; so is a
    max_tokens beyond the room left."""
    max_len = ok(http.get("/v1/models"))["data"][0]["max_model_len"]
    full = [100] * max_len
    for path, base in (("/v1/chat/completions", {"messages": PARIS}),
                       ("/v1/completions", {"prompt": "a"})):
        error = assert_error(http.post(path, json={**base, "prompt_token_ids": full}), 400)
        assert str(max_len) in error["message"]
    assert_error(http.post("/v1/completions", json={
        "prompt_token_ids": [100] * 10, "max_tokens": max_len - 9}), 400, "max_tokens")
    assert_error(http.post("/v1/chat/completions", json={
        "messages": PARIS, "max_completion_tokens": max_len}), 400, "max_completion_tokens")


def test_max_completion_tokens_is_honoured_over_max_tokens(client):
    """P-2: max_completion_tokens (the newer name) wins."""
    done = client.chat.completions.create(
        model=MODEL, messages=PARIS, max_tokens=5, max_completion_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert done.usage.completion_tokens == 2 and done.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- P-6 combinations


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"stream": False, "stream_options": {}}, "stream_options"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}},
      "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}},
      "prompt_token_ids": [1, 2, 3]}, "tool_choice"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/completions", {"logit_bias": {"hello": 5}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"3.5": 5}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"49152": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"-3": 5}}, "logit_bias"),
    ("/v1/completions", {"stop_token_ids": [10**7]}, "stop_token_ids"),
    ("/v1/completions", {"cache_salt": ""}, "cache_salt"),
])
def test_field_combinations_are_checked(http, path, extra, param):
    """P-6, P-7: each bad combination is a 400 with a clear message, before any work."""
    base = {"messages": PARIS} if "chat" in path else {"prompt": "a"}
    assert_error(http.post(path, json={**base, **extra}), 400, param)


def test_tool_choice_none_without_tools_is_fine(http):
    """P-6: `tool_choice: "none"` without tools is not an error."""
    chat(http, messages=PARIS, tool_choice="none", max_tokens=1)


# ---------------------------------------------------------------- P-3 extensions, P-9 stops


def test_top_k_1_and_min_p_1_equal_greedy(http):
    """P-3: top_k=1 and min_p=1 leave only the most likely token: sampling becomes greedy.

    One after another, so each runs in the same batches (alone): this stack is bfloat16,
    whose logits are 1/8 apart near 20, and this prompt has two tokens one such step apart,
    which another batch's summation order may swap."""
    base = {"prompt": "The three primary colors are", "max_tokens": 6, "ignore_eos": True}
    greedy, top_k, min_p = (
        complete(http, **body)["choices"][0]["text"]
        for body in (
            {**base, "temperature": 0},
            {**base, "temperature": 1.5, "seed": 11, "top_k": 1},
            {**base, "temperature": 1.5, "seed": 11, "min_p": 1.0},
        )
    )
    assert greedy == top_k == min_p


def test_min_tokens_gates_eos_and_stop_token_ids(http):
    """P-3, P-9: min_tokens comes first in the stop order: EOS and stop_token_ids cannot end
    the answer before it; afterwards EOS stops it."""
    paris = token_id(http, " Paris")
    free, gated, stopped, gated_stop = parallel(
        lambda b: complete(http, **b) if "prompt" in b else chat(http, **b),
        ({"messages": YES, "temperature": 0, "max_tokens": 8},),
        ({"messages": YES, "temperature": 0, "max_tokens": 6, "min_tokens": 6},),
        ({"prompt": FRANCE, "temperature": 0, "max_tokens": 4, "stop_token_ids": [paris]},),
        ({"prompt": FRANCE, "temperature": 0, "max_tokens": 2, "stop_token_ids": [paris],
          "min_tokens": 2},),
    )
    choice = free["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None  # EOS
    assert free["usage"]["completion_tokens"] < 6
    assert gated["choices"][0]["finish_reason"] == "length"
    assert gated["usage"]["completion_tokens"] == 6
    # stop_token_ids stop in the engine, on the token itself (P-9, O-3).
    choice = stopped["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", paris)
    assert stopped["usage"]["completion_tokens"] == 1
    assert gated_stop["choices"][0]["finish_reason"] == "length"
    assert not gated_stop["choices"][0]["text"].startswith(" Paris")


@pytest.mark.parametrize("include", [False, True])
def test_stop_tokens_stay_out_of_the_text_unless_asked(http, include):
    """O-3 (a product fix): the EOS or stop_token_id that ended the answer is not part of its
    text unless include_stop_str_in_output, even with skip_special_tokens false."""
    paris = token_id(http, " Paris")
    eos, stop_id = parallel(
        lambda b: chat(http, **b) if "messages" in b else complete(http, **b),
        ({"messages": YES, "temperature": 0, "max_tokens": 8, "skip_special_tokens": False,
          "include_stop_str_in_output": include},),
        ({"prompt": FRANCE, "temperature": 0, "max_tokens": 4, "stop_token_ids": [paris],
          "include_stop_str_in_output": include},),
    )
    content = eos["choices"][0]["message"]["content"]
    assert content.startswith("Yes")
    assert content.endswith("<|im_end|>") == include
    assert stop_id["choices"][0]["text"] == (" Paris" if include else "")


def test_stop_strings_are_matched_on_text(http):
    """P-9, O-3: stop strings match detokenized text, even inside a token ("swer" is part of
    " answer"); false cuts before the stop, true keeps it; stop_reason names the string."""
    base = {"prompt": FRANCE, "temperature": 0, "max_tokens": 12, "stop": ["swer", "zzz"]}
    cut, kept = parallel(
        lambda b: complete(http, **b)["choices"][0],
        (base,), ({**base, "include_stop_str_in_output": True},),
    )
    assert cut["text"] == " Paris.\n\nThe an"
    assert kept["text"] == " Paris.\n\nThe answer"
    for choice in (cut, kept):
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "swer")


def test_streaming_never_leaks_a_stop_string_prefix(http):
    """O-2, O-3: the streamed pieces add up to exactly the non-streamed text. Each stop string
    here spans several tokens, so a stream that sent text before knowing whether a stop would
    match would have sent its first tokens ("The", " is"...) and differ."""
    cases = [
        ("/v1/completions", {"prompt": FRANCE, "stop": ["The answer is"]}, " Paris.\n\n"),
        ("/v1/completions", {"prompt": FRANCE, "stop": ["xyz", "answer is:"],
                             "include_stop_str_in_output": True}, " Paris.\n\nThe answer is:"),
        ("/v1/chat/completions", {"messages": PARIS, "stop": ["France is Paris"]},
         "The capital of "),
        # Never matches: the held-back tail ("The answer") must still come out at the end.
        ("/v1/completions", {"prompt": FRANCE, "stop": ["The answer was"], "max_tokens": 6},
         None),
    ]
    calls = []
    for path, body, _ in cases:
        body = {"temperature": 0, "max_tokens": 9, **body}
        calls += [(path, body, False), (path, body, True)]

    def run(path, body, streaming):
        if streaming:
            events = stream(http, path, body)
            return streamed_text(events), [c["finish_reason"] for e in events
                                           for c in e["choices"]][-1]
        choice = ok(http.post(path, json=body))["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, choice["finish_reason"]

    results = parallel(run, *calls)
    for (path, body, expected), whole, streamed in zip(cases, results[::2], results[1::2],
                                                       strict=True):
        assert streamed == whole, (path, body)
        if expected is None:
            assert whole == (" Paris.\n\nThe answer", "length")
        else:
            assert whole == (expected, "stop")


def test_request_extensions(http):
    """P-3: prompt_token_ids (list and base64 int32) skip rendering; truncate_prompt_tokens
    keeps the most recent tokens; request_id names the response; cache_salt and priority are
    accepted (they reach the engine request, P-12: tests/unit/test_openai_translation.py)."""
    ids = ok(http.post("/tokenize", json={"prompt": FRANCE}))["tokens"]
    packed = base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()
    rid = f"proto-{time.monotonic_ns()}"
    base = {"temperature": 0, "max_tokens": 3}
    text, listed, b64, truncated, named, salted = parallel(
        lambda b: complete(http, **b),
        ({**base, "prompt": FRANCE},),
        ({**base, "prompt": ids},),
        ({**base, "prompt_token_ids": packed},),
        ({**base, "prompt": [100, 200, 300, *ids], "truncate_prompt_tokens": len(ids)},),
        ({**base, "prompt": FRANCE, "request_id": rid},),
        ({**base, "prompt": FRANCE, "cache_salt": "tenant-a", "priority": 5},),
    )
    for body in (listed, b64, truncated, named, salted):
        assert body["choices"][0]["text"] == text["choices"][0]["text"]
        assert body["usage"]["prompt_tokens"] == len(ids)
    assert named["id"] == f"cmpl-{rid}"
    chat_ids = chat(http, prompt_token_ids=ok(http.post("/tokenize", json={"messages": PARIS}))[
        "tokens"], messages=[], temperature=0, max_tokens=3)
    assert chat_ids["choices"][0]["message"]["content"] == chat(
        http, messages=PARIS, temperature=0, max_tokens=3)["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- P-7 logit_bias, P-11


def test_logit_bias_forces_and_bans(http):
    """P-7: +100 on a token id forces it; -100 on the greedy choice bans it; the last id of
    the real vocabulary is accepted."""
    apple = token_id(http, " apple")
    base = {"prompt": "Hello", "temperature": 0, "max_tokens": 3}
    forced, greedy, banned, last_id = parallel(
        lambda b: complete(http, **b)["choices"][0]["text"],
        ({**base, "logit_bias": {str(apple): 100}},),
        ({**base, "prompt": APPLES, "max_tokens": 1},),
        ({**base, "prompt": APPLES, "max_tokens": 1, "logit_bias": {str(apple): -100}},),
        ({**base, "max_tokens": 1, "logit_bias": {"49151": 0.5}},),
    )
    assert forced == " apple apple apple"
    assert greedy == " apple" and banned != " apple"
    assert isinstance(last_id, str)


def test_repetition_penalty_counts_the_prompt_presence_and_frequency_do_not(http):
    """P-11: the prompt repeats " apple" and greedy continues with it; repetition_penalty
    (prompt and output) steers away at once, presence/frequency (output only) do not."""
    base = {"prompt": APPLES, "temperature": 0, "max_tokens": 1}
    plain, repetition, presence, frequency = parallel(
        lambda b: complete(http, **b)["choices"][0]["text"],
        (base,), ({**base, "repetition_penalty": 2.0},), ({**base, "presence_penalty": 2.0},),
        ({**base, "frequency_penalty": 2.0},),
    )
    assert plain == presence == frequency == " apple"
    assert repetition != " apple"


def test_frequency_penalty_grows_with_repeats_presence_does_not(http):
    """P-11, exactly: " apple" is forced every step (+100 bias), so the other tokens' logits
    stay as they were and only the forced token's moves. After k repeats its logit is lower
    by f*k under frequency_penalty f and by p (once) under presence_penalty p, so the runner-up
    token's logprob rises by exactly that much against an unpenalized run."""
    apple = token_id(http, " apple")
    base = {"prompt": "Hello", "temperature": 0, "max_tokens": 5, "logprobs": 2,
            "logit_bias": {str(apple): 100}}
    plain, frequency, presence = parallel(
        lambda b: complete(http, **b)["choices"][0]["logprobs"]["top_logprobs"],
        (base,), ({**base, "frequency_penalty": 1.5},), ({**base, "presence_penalty": 1.5},),
    )

    def runner_up_gain(penalized):
        gains = []
        for before, after in zip(plain, penalized, strict=True):
            (first, _), (token, lp_before) = list(before.items())
            (first_after, _), (token_after, lp_after) = list(after.items())
            assert first == first_after == " apple" and token == token_after
            gains.append(lp_after - lp_before)
        return gains

    assert runner_up_gain(frequency) == pytest.approx([0, 1.5, 3.0, 4.5, 6.0], abs=1e-3)
    assert runner_up_gain(presence) == pytest.approx([0, 1.5, 1.5, 1.5, 1.5], abs=1e-3)


# ---------------------------------------------------------------- P-10 n and best_of


def test_n_and_best_of(client, http):
    """P-10: n=3 returns indexes 0..2; best_of=3, n=1 returns exactly one choice, the most
    likely of the three candidates; streamed n returns every index with its own finish."""
    many = client.chat.completions.create(model=MODEL, messages=PARIS, n=3, max_tokens=3,
                                          seed=5)
    assert [c.index for c in many.choices] == [0, 1, 2]
    base = {"prompt": "My favourite animal is the", "max_tokens": 3, "seed": 21,
            "ignore_eos": True, "temperature": 1.0}
    best, three = parallel(
        lambda b: complete(http, **b),
        ({**base, "best_of": 3, "n": 1},), ({**base, "n": 3, "logprobs": 0},),
    )
    assert [c["index"] for c in best["choices"]] == [0]
    assert best["choices"][0]["logprobs"] is None  # ranking needed them; nobody asked
    # The same seeds give the same three candidates; best_of keeps the most likely.
    scores = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in three["choices"]}
    assert best["choices"][0]["text"] == max(scores, key=scores.get)
    assert best["usage"]["completion_tokens"] == 9  # all candidates' tokens were generated
    events = stream(http, "/v1/chat/completions",
                    {"messages": PARIS, "n": 2, "max_tokens": 2, "seed": 3})
    roles = [c["index"] for e in events for c in e["choices"] if "role" in c["delta"]]
    finishes = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(roles) == sorted(finishes) == [0, 1]


def test_seeds_reproduce_and_differ(client):
    """P-2: the same seed gives the same text; different seeds give different texts."""
    def run(seed):
        return client.completions.create(model=MODEL, prompt="My favourite animal is the",
                                         max_tokens=6, seed=seed, temperature=1.0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a, again, b, c = parallel(run, (123,), (123,), (124,), (125,))
    assert a == again
    assert len({a, b, c}) > 1


# ---------------------------------------------------------------- O-1 streaming shape


def test_chat_stream_shape(http, client):
    """O-1: role first (content omitted, not ""), then content deltas, finish_reason and
    stop_reason only in the last choice chunk, usage only when asked, then [DONE]."""
    body = {"messages": PARIS, "temperature": 0, "max_tokens": 4}
    plain, usage, continuous = parallel(
        lambda b: stream(http, "/v1/chat/completions", b),
        (body,), ({**body, "stream_options": {"include_usage": True}},),
        ({**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},),
    )
    for events in (plain, usage, continuous):
        ids = {e["id"] for e in events}
        assert len(ids) == 1 and all(e["object"] == "chat.completion.chunk" for e in events)
        choice_events = [e for e in events if e["choices"]]
        first = choice_events[0]["choices"][0]
        assert first["delta"] == {"role": "assistant"} and first["finish_reason"] is None
        middle = [e["choices"][0] for e in choice_events[1:]]
        assert all("role" not in c["delta"] for c in middle)
        assert all(c["finish_reason"] is None and c["stop_reason"] is None for c in middle[:-1])
        assert middle[-1]["finish_reason"] == "length"
    assert all(e["usage"] is None for e in plain)
    assert [e for e in plain if not e["choices"]] == []
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == 4
    assert all(e["usage"] is None for e in usage[:-1])
    counts = [e["usage"]["completion_tokens"] for e in continuous]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + c
               for e, c in zip(continuous, counts, strict=True))
    # The official client reads the same stream.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        streamed_text(plain))


def test_stream_options_defaults_as_vllm(http):
    """Once stream_options is present include_usage defaults to true (vLLM's StreamOptions):
    `{}` ends with the usage chunk, continuous_usage_stats alone puts usage on every chunk,
    and include_usage false turns both off."""
    body = {"messages": PARIS, "temperature": 0, "max_tokens": 3}
    empty, continuous, off = parallel(
        lambda options: stream(http, "/v1/chat/completions",
                               {**body, "stream_options": options}),
        ({},), ({"continuous_usage_stats": True},),
        ({"include_usage": False, "continuous_usage_stats": True},),
    )
    assert empty[-1]["choices"] == [] and empty[-1]["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in empty[:-1])
    assert all(e["usage"] is not None for e in continuous)
    assert continuous[-1]["choices"] == [] and continuous[-1]["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in off) and all(e["choices"] for e in off)


def test_completion_stream_shape(http):
    """O-1 for completions: text chunks, one finish at the end, usage only when asked."""
    events = stream(http, "/v1/completions", {
        "prompt": FRANCE, "temperature": 0, "max_tokens": 4,
        "stream_options": {"include_usage": True}})
    assert all(e["object"] == "text_completion" for e in events)
    finishes = [c["finish_reason"] for e in events for c in e["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path, key, prompts", [
    ("/v1/completions", "prompt", ["Once upon a time", "def fibonacci(n):", FRANCE]),
    ("/v1/chat/completions", "messages",
     [PARIS, [{"role": "user", "content": "Name a fruit."}], YES]),
])
def test_greedy_streaming_equals_non_streaming(http, path, key, prompts):
    """O-1, O-7: the same greedy request gives the same text, finish and usage either way."""
    calls = []
    for prompt in prompts:
        body = {key: prompt, "temperature": 0, "max_tokens": 8,
                "stream_options": {"include_usage": True}}
        calls += [(body, False), (body, True)]

    def run(body, streaming):
        if streaming:
            events = stream(http, path, body)
            finish = [c["finish_reason"] for e in events for c in e["choices"]][-1]
            return streamed_text(events), finish, events[-1]["usage"]
        body = {k: v for k, v in body.items() if k != "stream_options"}
        choice = (response := ok(http.post(path, json=body)))["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, choice["finish_reason"], response["usage"]

    results = parallel(run, *calls)
    for whole, streamed in zip(results[::2], results[1::2], strict=True):
        assert streamed == whole


# ---------------------------------------------------------------- O-4 logprobs


def test_chat_logprobs_shape(client, http):
    """O-4: chat {content: [{token, logprob, bytes, top_logprobs}]}, top_logprobs of the asked
    length, one entry per generated token; streamed chunks carry their own entries."""
    done = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0,
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 3
    assert "".join(e.token for e in content) == done.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top one
    events = stream(http, "/v1/chat/completions", {
        "messages": PARIS, "temperature": 0, "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2})
    streamed = [e for ev in events for c in ev["choices"] if c["logprobs"]
                for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e.token for e in content]
    without = chat(http, messages=PARIS, max_tokens=1, logprobs=True)["choices"][0]
    assert without["logprobs"]["content"][0]["top_logprobs"] == []
    assert chat(http, messages=PARIS, max_tokens=1)["choices"][0]["logprobs"] is None


def test_completion_logprobs_shape_and_echo(http):
    """O-4: completions {tokens, token_logprobs, top_logprobs, text_offset}; with echo the
    prompt's tokens come first and the very first has no logprob (null)."""
    plain, echoed = parallel(
        lambda b: complete(http, **b)["choices"][0],
        ({"prompt": FRANCE, "temperature": 0, "max_tokens": 3, "logprobs": 2},),
        ({"prompt": FRANCE, "temperature": 0, "max_tokens": 3, "logprobs": 1, "echo": True},),
    )
    lp = plain["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert "".join(lp["tokens"]) == plain["text"]
    assert all(len(top) == 2 for top in lp["top_logprobs"])
    assert lp["text_offset"] == [0, len(lp["tokens"][0]), len("".join(lp["tokens"][:2]))]
    assert all(math.isfinite(x) and x <= 0 for x in lp["token_logprobs"])
    assert echoed["text"] == FRANCE + plain["text"]
    elp = echoed["logprobs"]
    prompt_len = len(elp["tokens"]) - 3
    assert "".join(elp["tokens"][:prompt_len]) == FRANCE
    assert elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
    assert all(x is not None for x in elp["token_logprobs"][1:])
    # Each position's own token, then the best alternative (the same token when it is it).
    assert all(token in top and 1 <= len(top) <= 2
               for token, top in zip(elp["tokens"][1:], elp["top_logprobs"][1:], strict=True))
    assert elp["text_offset"][prompt_len] == len(FRANCE)
    assert elp["tokens"][prompt_len:] == lp["tokens"]


# ---------------------------------------------------------------- O-7 usage


def test_usage_arithmetic(http, client):
    """O-7: prompt_tokens is the rendered prompt's length; completion_tokens sums every
    choice's tokens; total is their sum; a stream's usage equals the non-streamed one."""
    prompt_tokens = ok(http.post("/tokenize", json={"messages": PARIS}))["count"]
    done = client.chat.completions.create(model=MODEL, messages=PARIS, n=2, max_tokens=3,
                                          seed=9, logprobs=True)
    usage = done.usage
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == sum(len(c.logprobs.content) for c in done.choices)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    legacy = client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=2, n=2,
                                       temperature=0)
    assert legacy.usage.completion_tokens == 4
    assert legacy.usage.total_tokens == legacy.usage.prompt_tokens + 4


# ---------------------------------------------------------------- batched prompts


def test_batched_completion_prompts(http):
    """A list of prompts (strings or token-id lists) runs each; choices come back in prompt
    order, n per prompt, each equal to the prompt sent alone; usage adds up."""
    prompts = ["Once upon a time", FRANCE]
    alone = parallel(lambda p: complete(http, prompt=p, temperature=0, max_tokens=5),
                     *[(p,) for p in prompts])
    texts = [r["choices"][0]["text"] for r in alone]
    batch = complete(http, prompt=prompts, n=2, temperature=0, max_tokens=5)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in batch["choices"]] == [texts[0], texts[0], texts[1], texts[1]]
    assert batch["usage"]["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in alone)
    assert batch["usage"]["completion_tokens"] == 4 * 5
    ids = [ok(http.post("/tokenize", json={"prompt": p}))["tokens"] for p in prompts]
    by_ids = complete(http, prompt=ids, temperature=0, max_tokens=5, echo=True)
    assert [c["text"] for c in by_ids["choices"]] == [
        f"{http.post('/detokenize', json={'tokens': i}).json()['prompt']}{t}"
        for i, t in zip(ids, texts, strict=True)]
    events = stream(http, "/v1/completions", {"prompt": prompts, "temperature": 0,
                                              "max_tokens": 5, "echo": True})
    assert [streamed_text(events, i) for i in (0, 1)] == [
        p + t for p, t in zip(prompts, texts, strict=True)]
    assert_error(http.post("/v1/completions", json={"prompt": ["a", 5], "max_tokens": 1}),
                 400, "prompt")
