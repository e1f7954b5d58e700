"""Every bound on a request, over HTTP, on every route that has the field (issue 15 items 1, 2,
6): the value at the bound passes, one past it is a 400 naming the field (Anthropic's shape
under /v1/messages, whose message names it), and the engine lives on. The fuzzer's findings
are here too: top_k 2**63 killed the engine, big seeds and priorities, `"--5"` bias keys and
JSON a thousand levels deep were 500s.

A frontend with small maxima (so the boundary requests stay cheap: n = 2, not 128) over the
session's shared engine (`shared_engine`): every bound here is the frontend's.
tests/unit/test_input_bounds.py has the exact edges of every range without processes."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.slow  # starts a frontend of its own

MODEL = "SmolLM2-135M-Instruct"
DEPTH = 10
LIMITS = ("--max-n", "2", "--max-prompts-per-request", "2", "--max-messages", "3",
          "--max-tools", "2", "--max-stop-strings", "2", "--max-json-depth", str(DEPTH))
USER = [{"role": "user", "content": "Say yes."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}

# A minimal request per route; one token of answer.
BASE = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 1},
    "/v1/completions": {"prompt": "Say yes.", "max_tokens": 1},
    "/v1/responses": {"input": "Say yes.", "max_output_tokens": 1, "store": False},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 1},
    "/tokenize": {"messages": USER},
}
CHAT, COMPLETIONS, RESPONSES, MESSAGES, TOKENIZE = BASE


def nested(levels: int):
    return json.loads("[" * levels + "]" * levels)


# Stands for a list nested a thousand levels deep, which json.dumps itself cannot write.
DEEP = "<a thousand levels>"


def deep_text(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.fixture(scope="module")
def url(shared_engine, tmp_path_factory):
    frontend = shared_engine.frontend(str(tmp_path_factory.mktemp("bounds")), "bounds", *LIMITS)
    yield frontend.base_url
    frontend.stop()


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def post(http, path: str, **fields) -> httpx.Response:
    body = json.dumps({**BASE[path], **fields}).replace(json.dumps(DEEP), deep_text(1000))
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


def passes(http, path: str, **fields) -> None:
    r = post(http, path, **fields)
    assert r.status_code == 200, r.text


def refused(http, path: str, field: str, **fields) -> None:
    """A 400 naming `field`: as `param`, or in the message under /v1/messages."""
    r = post(http, path, **fields)
    assert r.status_code == 400, r.text
    body = r.json()
    if path == MESSAGES:
        assert body["type"] == "error" and field in body["error"]["message"], body
    else:
        assert body["error"]["param"] == field, body
        assert body["error"]["code"] == 400


def still_serving(http) -> None:
    assert http.get("/health").status_code == 200
    passes(http, CHAT)


# ---------------------------------------------------------------- numbers


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, RESPONSES, MESSAGES])
def test_top_k_past_int64_is_a_400_and_the_engine_lives(http, path):
    refused(http, path, "top_k", top_k=2**63)
    refused(http, path, "top_k", top_k=2**31)
    passes(http, path, top_k=2**31 - 1)
    still_serving(http)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, RESPONSES])
@pytest.mark.parametrize("field", ["seed", "priority"])
def test_int64_fields(http, path, field):
    passes(http, path, **{field: 2**63 - 1})
    passes(http, path, **{field: -(2**63)})
    refused(http, path, field, **{field: 2**63})
    refused(http, path, field, **{field: 2**70})
    refused(http, path, field, **{field: -(2**63) - 1})


@pytest.mark.parametrize("path, field", [
    (CHAT, "max_tokens"), (CHAT, "max_completion_tokens"), (COMPLETIONS, "max_tokens"),
    (RESPONSES, "max_output_tokens"), (MESSAGES, "max_tokens"),
])
def test_token_counts_fit_int32(http, path, field):
    refused(http, path, field, **{field: 2**31})
    refused(http, path, field, **{field: 0})


@pytest.mark.parametrize("path, value, field", [
    (CHAT, {"temperature": 100.5}, "temperature"),
    (CHAT, {"top_p": 1e-7}, "top_p"),
    (COMPLETIONS, {"repetition_penalty": 0.001}, "repetition_penalty"),
    (RESPONSES, {"temperature": 1e300}, "temperature"),
    (RESPONSES, {"min_tokens": 2**31}, "min_tokens"),
    (MESSAGES, {"top_p": 0}, "top_p"),
])
def test_floats_and_other_ranges(http, path, value, field):
    refused(http, path, field, **value)


def test_a_subnormal_temperature_answers(http):
    passes(http, CHAT, temperature=1e-45)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("key", ["--5", " 5", "1_0", "٣", "5" * 5000])
def test_logit_bias_keys(http, path, key):
    refused(http, path, "logit_bias", logit_bias={key: 1})


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_token_ids_and_logit_bias_entries(http, path):
    passes(http, path, stop_token_ids=[0] * 128, logit_bias={str(i): 1 for i in range(1024)})
    refused(http, path, "stop_token_ids", stop_token_ids=[0] * 129)
    refused(http, path, "logit_bias", logit_bias={str(i): 1 for i in range(1025)})


# ---------------------------------------------------------------- fan-out


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_n(http, path):
    passes(http, path, n=2)
    refused(http, path, "n", n=3)
    refused(http, path, "n", n=2**63)  # refused at once, before any candidate is built


def test_best_of(http):
    passes(http, COMPLETIONS, n=1, best_of=2)
    refused(http, COMPLETIONS, "best_of", best_of=3)
    # Greedy is one definition across tiers (below 1e-5, as the sampler's): 1e-6 would run
    # identical candidates, so it is refused as temperature 0 is; 1e-4 samples.
    refused(http, COMPLETIONS, "best_of", best_of=2, temperature=1e-6)
    refused(http, COMPLETIONS, "best_of", best_of=2, temperature=0)
    passes(http, COMPLETIONS, best_of=2, temperature=1e-4)


def test_prompts_per_completions_request(http):
    passes(http, COMPLETIONS, prompt=["a", "b"])
    refused(http, COMPLETIONS, "prompt", prompt=["a", "b", "c"])
    refused(http, COMPLETIONS, "prompt", prompt=[[1], [2], [3]])


@pytest.mark.parametrize("path, field, at_bound, past", [
    (CHAT, "messages", USER * 3, USER * 4),
    (RESPONSES, "input", [{"role": "user", "content": "yes"}] * 3,
     [{"role": "user", "content": "yes"}] * 4),
    (MESSAGES, "messages", [*USER, {"role": "assistant", "content": "Yes"}, *USER],
     [*USER, {"role": "assistant", "content": "Yes"}] * 2),
    (TOKENIZE, "messages", USER * 3, USER * 4),
])
def test_messages(http, path, field, at_bound, past):
    passes(http, path, **{field: at_bound})
    refused(http, path, field, **{field: past})


@pytest.mark.parametrize("path, tool, extra", [
    (CHAT, TOOL, {"tool_choice": "none"}),
    (RESPONSES, RESPONSES_TOOL, {"tool_choice": "none"}),
    (MESSAGES, ANTHROPIC_TOOL, {"tool_choice": {"type": "none"}}),
    (TOKENIZE, TOOL, {}),
])
def test_tools(http, path, tool, extra):
    def tools(n: int) -> list[dict]:  # names must differ (issue 40)
        if "function" in tool:
            return [{**tool, "function": {**tool["function"], "name": f"f{i}"}}
                    for i in range(n)]
        return [{**tool, "name": f"f{i}"} for i in range(n)]

    passes(http, path, tools=tools(2), **extra)
    refused(http, path, "tools", tools=tools(3), **extra)


@pytest.mark.parametrize("path, field", [
    (CHAT, "stop"), (COMPLETIONS, "stop"), (RESPONSES, "stop"), (MESSAGES, "stop_sequences"),
])
def test_stop_strings(http, path, field):
    passes(http, path, **{field: ["x", "y"]})
    refused(http, path, field, **{field: ["x", "y", "z"]})


# ---------------------------------------------------------------- JSON depth


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES])
def test_metadata_depth(http, path):
    # The body is level 1 and metadata level 2: DEPTH - 2 more levels of list fit.
    passes(http, path, metadata={"a": nested(DEPTH - 2)})
    refused(http, path, "metadata.a[0][0][0][0]", metadata={"a": nested(DEPTH - 1)})
    refused(http, path, "metadata.a[0][0][0][0]", metadata={"a": DEEP})
    still_serving(http)


def test_deep_json_in_every_free_form_place(http):
    deep_call = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_text(1000)}}]}
    refused(http, CHAT, "messages[1].tool_calls[0].function.arguments",
            messages=[*USER, deep_call, {"role": "tool", "tool_call_id": "c1", "content": "1"}])
    refused(http, TOKENIZE, "messages[1].tool_calls[0].function.arguments",
            messages=[*USER, deep_call])
    refused(http, CHAT, "guided_json", guided_json=deep_text(1000))
    refused(http, COMPLETIONS, "structured_outputs.json",
            structured_outputs={"json": deep_text(1000)})
    refused(http, CHAT, "response_format.json_schema.schema",
            response_format={"type": "json_schema", "json_schema": {"schema": deep_text(1000)}})
    refused(http, CHAT, "tools[0].function.parameters.x[0]",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {
                "x": DEEP}}}], tool_choice="none")
    refused(http, MESSAGES, "messages",
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                    "content": DEEP}]}])
    # Checked after translation: the path is the chat request's (its messages, not `input`).
    r = post(http, RESPONSES, input=[
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": deep_text(1000)},
        {"type": "function_call_output", "call_id": "c", "output": "1"}])
    assert r.status_code == 400
    assert r.json()["error"]["param"].endswith("tool_calls[0].function.arguments")
    r = http.post("/detokenize", content=b'{"tokens": ' + deep_text(5000).encode() + b"}")
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens[0]")
    still_serving(http)
