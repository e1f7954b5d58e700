"""Output-side fidelity through the HTTP API with the official openai client, on the default
model with `--tool-call-parser hermes` (issue 17), a frontend of its own over the session's shared
engine (`shared_engine`): forced calls over pydantic-style schemas,
bounded JSON numbers, forced calls cut by max_tokens, streamed arguments, and stop strings
under min_tokens."""

import json
import re

import jsonschema
import openai
import pytest

from tests.unit.test_parser_fidelity import PYDANTIC_SCHEMA

MODEL = "SmolLM2-135M-Instruct"
SHIP = {"type": "function", "function": {
    "name": "ship", "description": "Ship a parcel to a person", "parameters": PYDANTIC_SCHEMA}}


@pytest.fixture(scope="module")
def client(shared_engine, tmp_path_factory):
    frontend = shared_engine.frontend(str(tmp_path_factory.mktemp("fidelity")), "fidelity",
                                      "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0)
    frontend.stop()


def ask(client, content: str, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **extra)


# ---------------------------------------------------------------- 1: $ref / $defs


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "ship"}}])
def test_forced_calls_over_a_pydantic_schema(client, choice):
    """A pydantic model's schema ($defs for the nested model) works for forced calls as it
    does in response_format, and the call follows it, nested $ref included."""
    r = ask(client, "Ship a parcel to Ann in Paris.", tools=[SHIP], tool_choice=choice,
            parallel_tool_calls=False, max_tokens=120, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "ship"
    jsonschema.validate(json.loads(call.function.arguments), PYDANTIC_SCHEMA)


def test_strict_tools_with_a_pydantic_schema_are_accepted(client):
    """A strict tool's $refs resolve (this was a 400: Pointer '/$defs/Address' does not
    exist), and its call follows the schema. The call is forced: left to choose, this model
    answers in prose, and a test that looked at its calls then checked nothing."""
    strict = {"type": "function", "function": {**SHIP["function"], "strict": True}}
    r = ask(client, "Ship a parcel to Ann in Paris.", tools=[strict], tool_choice="required",
            parallel_tool_calls=False, max_tokens=120, temperature=0)
    assert r.choices[0].message.tool_calls, r.choices[0].message.content
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "ship"
    jsonschema.validate(json.loads(call.function.arguments), PYDANTIC_SCHEMA)


# ---------------------------------------------------------------- 15: bounded numbers

ONE = 33  # "1" in SmolLM2's vocabulary: biased up, a model writes 1s wherever it may


def test_json_numbers_end_after_16_integral_and_10_fraction_digits(client):
    """An unconstrained integer lets a model loop on digits to max_tokens; the grammar ends
    the number after 16 integral digits (10 fraction digits for a number)."""
    schema = {"type": "object", "properties": {"population": {"type": "integer"},
                                               "ratio": {"type": "number"}},
              "required": ["population", "ratio"], "additionalProperties": False}
    r = ask(client, "Population of Paris as JSON.", max_tokens=80, temperature=0,
            logit_bias={str(ONE): 100},
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    text = r.choices[0].message.content
    value = json.loads(text)
    assert value["population"] == int("1" * 16), text
    ratio = re.search(r'"ratio": ([^}]*)}', text).group(1)
    assert re.fullmatch(r"-?[0-9]{1,16}(\.[0-9]{1,10})?", ratio), text


# ---------------------------------------------------------------- 7: forced calls cut short

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice, max_tokens", [("required", 2), ("required", 12),
                                                (NAMED, 3), (NAMED, 9)])
def test_a_forced_call_cut_by_max_tokens_leaks_no_markup(client, choice, max_tokens):
    """Cut inside `<tool_call>` or inside the call's JSON: no raw text comes back as
    content, streamed or not, and the answer ends with "length"."""
    r = ask(client, "Weather in Paris?", tools=[WEATHER], tool_choice=choice,
            max_tokens=max_tokens, temperature=0)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "length"
    assert not choice0.message.content, choice0.message.content
    stream = ask(client, "Weather in Paris?", tools=[WEATHER], tool_choice=choice,
                 max_tokens=max_tokens, temperature=0, stream=True)
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


# ---------------------------------------------------------------- 14: arguments stream


def test_tool_call_arguments_stream_as_they_are_generated(client):
    """As vLLM's hermes parser streams: the id/type/name delta, then the arguments in
    fragments as the model writes them, adding up to what the non-streamed answer says."""
    city = {"type": "function", "function": {**WEATHER["function"], "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}}
    fields = dict(tools=[city], tool_choice=NAMED, max_tokens=60, temperature=0)
    whole = ask(client, "Weather in Paris for 3 days?", **fields)
    [call] = whole.choices[0].message.tool_calls
    deltas = []
    for chunk in ask(client, "Weather in Paris for 3 days?", stream=True, **fields):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            deltas.append(c)
    head, *rest = deltas
    assert head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert len(rest) > 3, rest  # several pieces, not the whole arguments at the end
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    streamed = "".join(d.function.arguments for d in rest)
    assert streamed == call.function.arguments
    assert set(json.loads(streamed)) == {"city", "days"}


# ---------------------------------------------------------------- 8: stop strings, min_tokens


def test_stop_strings_wait_for_min_tokens(client):
    """EOS and stop ids wait for min_tokens, and so do stop strings: " " stops this
    completion at once ("Paris" starts with a space) unless min_tokens holds it."""
    fields = dict(model=MODEL, prompt="The capital of France is", max_tokens=40,
                  temperature=0, stop=[" "])
    bare = client.completions.create(**fields)
    assert bare.choices[0].text == "" and bare.choices[0].finish_reason == "stop"
    held = client.completions.create(extra_body={"min_tokens": 20}, **fields)
    text = held.choices[0].text
    assert " " in text and held.usage.completion_tokens >= 20, text
    assert held.choices[0].finish_reason in ("stop", "length")
    chat = ask(client, "Say a long sentence about Paris.", max_tokens=40, temperature=0,
               stop=[" "], extra_body={"min_tokens": 15})
    assert chat.choices[0].message.content.count(" ") >= 3, chat.choices[0].message.content
