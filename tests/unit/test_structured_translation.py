"""frontend.input.structured: requests -> llguidance grammars (req P-6, P-8, C-1 to C-3). The
grammars are checked by running llguidance matchers on the real SmolLM2 tokenizer."""

import json

import llguidance.hf
import msgspec
import pytest
from llguidance import LLMatcher

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.base.errors import APIError
from frontend.input.structured import StructuredSettings, build_constraint, forced_call_prefix
from frontend.pipeline.sampling import check_request, plan_request
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def llt():
    return llguidance.hf.from_tokenizer(load_tokenizer(default_model_path()), eos_token=[2])


@pytest.fixture(scope="module")
def hermes(llt):
    return StructuredSettings(tool_call_parser="hermes", tokenizer=llt)


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


NO_PARSERS = StructuredSettings()


def constraint(request, settings=NO_PARSERS):
    check_request(request, settings)
    plan = plan_request(request, endpoint="chat", prompt_len=4, max_model_len=64,
                        vocab_size=49152, constraint=build_constraint(request, settings))
    return plan.params.constraint


def refused(request, settings=NO_PARSERS) -> APIError:
    with pytest.raises(APIError) as info:
        constraint(request, settings)
    assert info.value.status == 400
    return info.value


def accepts(llt, grammar: str, text: str) -> bool:
    matcher = LLMatcher(llt, grammar, log_level=0)
    return matcher.consume_tokens(llt.tokenize_str(text)) and matcher.is_accepting()


def test_text_and_nothing_mean_no_constraint():
    assert constraint(chat()) is None
    assert constraint(chat(response_format={"type": "text"})) is None


def test_json_schema_and_json_object(llt):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
              "required": ["n"]}
    c = constraint(chat(response_format={"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": schema}}))
    assert c.kind == "json_schema"
    assert accepts(llt, c.grammar, '{"n": 7}') and not accepts(llt, c.grammar, '{"n": 12}')
    c = constraint(chat(response_format={"type": "json_object"}))
    assert accepts(llt, c.grammar, '{"a": [1, 2]}') and not accepts(llt, c.grammar, '[1]')


def test_vllm_fields_and_their_older_names(llt):
    for fields in ({"guided_regex": "[0-9]{2}"}, {"structured_outputs": {"regex": "[0-9]{2}"}}):
        c = constraint(chat(**fields))
        assert accepts(llt, c.grammar, "42") and not accepts(llt, c.grammar, "4a")
    completion = msgspec.convert({"prompt": "x", "guided_regex": "[0-9]"}, CompletionRequest)
    check_request(completion)
    plan = plan_request(completion, endpoint="completions", prompt_len=2, max_model_len=64,
                        vocab_size=49152, constraint=build_constraint(completion, NO_PARSERS))
    assert plan.params.constraint.kind == "regex"
    c = constraint(chat(guided_choice=["red", "grün"]))
    assert accepts(llt, c.grammar, "grün") and not accepts(llt, c.grammar, "blue")
    c = constraint(chat(structured_outputs={"grammar": 'start: "a"+ "b"'}))
    assert accepts(llt, c.grammar, "aab")
    c = constraint(chat(guided_json='{"type": "array", "items": {"type": "boolean"}}'))
    assert accepts(llt, c.grammar, "[true, false]")


@pytest.mark.parametrize("fields, param, quoted", [
    ({"guided_regex": "[a-z+"}, "guided_regex", "unclosed character class"),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs.json",
     "Invalid type"),
    ({"structured_outputs": {"json": '{"type": '}}, "structured_outputs.json", "not valid JSON"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", 'unknown name: "foo"'),
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "string", "pattern": "(a"}}}},
     "response_format.json_schema", "regex"),
])
def test_invalid_constraints_quote_the_problem(fields, param, quoted):
    error = refused(chat(**fields))
    assert error.param == param and quoted in error.message


def test_only_one_constraint(hermes):
    error = refused(chat(guided_json={"type": "object"}, response_format={"type": "json_object"}))
    assert "only one" in error.message
    refused(chat(structured_outputs={"regex": "a", "choice": ["a"]}))


def test_tools_need_a_parser_unless_tool_choice_is_none():
    assert constraint(chat(tools=[WEATHER], tool_choice="none")) is None
    error = refused(chat(tools=[WEATHER]))
    assert error.param == "tools" and "--tool-call-parser" in error.message
    refused(chat(tools=[WEATHER], tool_choice="required"))


def test_auto_without_strict_tools_is_free(hermes):
    assert constraint(chat(tools=[WEATHER]), hermes) is None
    assert constraint(chat(tools=[WEATHER], tool_choice="auto"), hermes) is None


def test_required_forces_a_valid_call(llt, hermes):
    c = constraint(chat(tools=[WEATHER, TIME], tool_choice="required"), hermes)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(llt, c.grammar, call) and accepts(llt, c.grammar, call + "\n" + other)
    assert not accepts(llt, c.grammar, "Sure! " + call)  # no content before the call
    assert not accepts(llt, c.grammar, call.replace('"city"', '"town"'))
    assert not accepts(llt, c.grammar, call.replace("get_weather", "get_wether"))
    once = constraint(chat(tools=[WEATHER, TIME], tool_choice="required",
                           parallel_tool_calls=False), hermes)
    assert accepts(llt, once.grammar, call) and not accepts(llt, once.grammar,
                                                            call + "\n" + other)


def test_required_leaves_thinking_free(llt):
    settings = StructuredSettings(tool_call_parser="hermes", reasoning_parser="qwen3",
                                  tokenizer=llt)
    c = constraint(chat(tools=[WEATHER], tool_choice="required"), settings)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(llt, c.grammar, "<think>\nweather, so <tool_call> it\n</think>\n\n" + call)
    assert accepts(llt, c.grammar, call)


def test_named_tool_choice_injects_the_marker_and_constrains_the_rest(llt, hermes):
    request = chat(tools=[WEATHER, TIME],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced_call_prefix(request, hermes) == "<tool_call>"
    c = constraint(request, hermes)
    rest = '\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert accepts(llt, c.grammar, rest)
    assert not accepts(llt, c.grammar, rest.replace("get_weather", "get_time"))
    assert forced_call_prefix(chat(tools=[WEATHER]), hermes) == ""


def test_strict_tools_trigger_on_the_begin_marker(llt, hermes):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    c = constraint(chat(tools=[strict, TIME]), hermes)
    good = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}' \
           '\n</tool_call>\nDone.'
    assert accepts(llt, c.grammar, "Just text, no call.")
    assert accepts(llt, c.grammar, good)
    assert not accepts(llt, c.grammar, good.replace('"city"', '"zip"'))
    # With a response_format of its own both would hold the whole answer: a 400 naming it,
    # never one of them dropped (issue 17 item 11).
    error = refused(chat(tools=[strict], response_format={"type": "json_object"}), hermes)
    assert error.param == "response_format" and "strict tools" in error.message


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "guided_json": {"type": "object"}}, "cannot be combined"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "response_format": {"type": "json_object"}}, "response_format"),
])
def test_tool_conflicts_are_400s(hermes, fields, message):
    assert message in refused(chat(tools=[WEATHER], **fields), hermes).message


def test_a_named_tool_choice_takes_a_text_response_format(llt, hermes):
    # "text" asks for no constraint, so it cannot conflict with the forced call (issue 31).
    named = {"type": "function", "function": {"name": "get_weather"}}
    plain = constraint(chat(tools=[WEATHER], tool_choice=named), hermes)
    with_text = constraint(chat(tools=[WEATHER], tool_choice=named,
                                response_format={"type": "text"}), hermes)
    assert with_text is not None and with_text.grammar == plain.grammar
    assert accepts(llt, with_text.grammar,
                   '\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def test_parsers_without_a_grammar_refuse_forced_calls(monkeypatch):
    # Every bundled parser has a grammar; one without (empty begin_lark) is refused.
    from postproc.tool_parsers.pythonic import PythonicToolParser
    monkeypatch.setattr(PythonicToolParser, "begin_lark", "")
    settings = StructuredSettings(tool_call_parser="pythonic")
    assert "pythonic" in refused(chat(tools=[WEATHER], tool_choice="required"),
                                 settings).message
    assert constraint(chat(tools=[WEATHER]), settings) is None  # auto stays free


def test_special_token_markers_are_checked_against_the_vocabulary(llt):
    # SmolLM2 has no <|python_tag|>: with the model's tokenizer, validation says so.
    settings = StructuredSettings(tool_call_parser="llama3_json", tokenizer=llt)
    error = refused(chat(tools=[WEATHER], tool_choice="required"), settings)
    assert "python_tag" in error.message
