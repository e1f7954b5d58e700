"""Constraints for gpt-oss (Harmony): tool_choice required / named and strict tools force
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, and
response_format holds only the `final` channel's body, never the analysis. Checked with
llguidance matchers on SmolLM2's tokenizer with the Harmony special tokens added; what the
grammars let through reads back through the Harmony parsers as the call / answer."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance.hf
import msgspec
import pytest
from llguidance import LLMatcher

from frontend.base.api_models import ChatCompletionRequest
from frontend.input.structured import StructuredSettings, build_constraint, forced_call_prefix
from frontend.pipeline.sampling import check_request
from postproc.reasoning import get_reasoning_parser
from postproc.tool_parsers import get_tool_parser
from tests.harmony_model import harmony_tokenizer
from tests.unit.test_forced_call_grammars import WEATHER, WEATHER_SCHEMA, sample

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
THINK = "<|channel|>analysis<|message|>Rain? Check.<|end|><|start|>assistant"


@pytest.fixture(scope="module")
def llt():
    tok = harmony_tokenizer()
    eos = [tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")]
    return llguidance.hf.from_tokenizer(tok, eos_token=eos)


def settings(llt) -> StructuredSettings:
    return StructuredSettings(tool_call_parser="openai", reasoning_parser="openai_gptoss",
                              tokenizer=llt)


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def grammar(llt, request) -> str:
    check_request(request, settings(llt))
    return build_constraint(request, settings(llt)).grammar


def accepts(llt, grammar_text: str, text: str) -> bool:
    matcher = LLMatcher(llt, grammar_text, log_level=0)
    return matcher.consume_tokens(llt.tokenize_str(text)) and matcher.is_accepting()


def read(text: str, prefill: str = ""):
    """(reasoning, content, [(name, arguments)]) as the postproc step reads the output."""
    reasoning, content = get_reasoning_parser("openai_gptoss")("").parse(text)
    if prefill:  # a named tool_choice: no reasoning parser, the tool parser reads it raw
        reasoning, content = None, text
    parsed = get_tool_parser("openai")([WEATHER, TIME], prefill=prefill).parse(content or "")
    return reasoning, parsed.content, [(c.function.name, json.loads(c.function.arguments))
                                       for c in parsed.calls]


def test_required_forces_a_harmony_call_after_optional_analysis(llt):
    g = grammar(llt, chat(tools=[WEATHER, TIME], tool_choice="required"))
    args = '{"city": "Oslo", "days": 2}'
    for text, reasoning in ((CALL + args, None), (THINK + CALL + args, "Rain? Check.")):
        assert accepts(llt, g, text), text
        assert read(text) == (reasoning, None, [("get_weather", json.loads(args))])
    for bad in ("<|channel|>final<|message|>No call.",
                CALL.replace("get_weather", "get_wether") + args,
                CALL + '{"city": 3}',
                "Sure. " + CALL + args):
        assert not accepts(llt, g, bad), bad


def test_required_outputs_sampled_at_random_read_back_as_calls(llt):
    g = grammar(llt, chat(tools=[WEATHER, TIME], tool_choice="required"))
    rng = random.Random(3)
    done = 0
    for _ in range(8):
        text = sample(llt, g, rng)
        if text is None:
            continue
        done += 1
        _, content, calls = read(text)
        assert content is None and len(calls) == 1, text
        if calls[0][0] == "get_weather":
            jsonschema.validate(calls[0][1], WEATHER_SCHEMA)
    assert done >= 3


def test_named_tool_choice_injects_the_recipient_opening(llt):
    request = chat(tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    prefix = forced_call_prefix(request, settings(llt))
    assert prefix == "<|channel|>commentary to=functions."
    g = grammar(llt, request)
    rest = 'get_time <|constrain|>json<|message|>{"tz": "UTC"}'
    assert accepts(llt, g, rest)
    assert not accepts(llt, g, 'get_weather <|constrain|>json<|message|>{"city": "x"}')
    assert read(rest, prefill=prefix) == (None, None, [("get_time", {"tz": "UTC"})])


def test_strict_tools_leave_messages_free_and_hold_calls(llt):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    g = grammar(llt, chat(tools=[strict]))
    answer = THINK + "<|channel|>final<|message|>It is <b>fine</b>."
    assert accepts(llt, g, answer)
    assert read(answer) == ("Rain? Check.", "It is <b>fine</b>.", [])
    assert accepts(llt, g, THINK + CALL + '{"city": "Oslo"}')
    assert not accepts(llt, g, THINK + CALL + '{"town": "Oslo"}')
    assert not accepts(llt, g, CALL.replace("get_weather", "rm_rf") + "{}")


def test_response_format_holds_only_the_final_channel(llt):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    g = grammar(llt, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}))
    final = '<|channel|>final<|message|>{"n": 4}'
    for text, reasoning in ((final, None),
                            ("<|channel|>analysis<|message|>free { text<|end|>"
                             "<|start|>assistant" + final, "free { text")):
        assert accepts(llt, g, text), text
        assert read(text) == (reasoning, '{"n": 4}', [])
    assert not accepts(llt, g, '<|channel|>final<|message|>{"n": "four"}')
    assert not accepts(llt, g, '{"n": 4}')


def test_response_format_with_a_bad_schema_is_a_400(llt):
    from frontend.base.errors import APIError

    with pytest.raises(APIError) as info:
        grammar(llt, chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": "{not json"}}))
    assert info.value.status == 400
