"""Output-side fidelity (issue 17): forced-call grammars over schemas with local `$ref`s,
bounded JSON numbers, unfinished forced calls, special tokens, streamed arguments, and stop
strings under min_tokens. Each test fails without its fix."""

import json

import jsonschema
import llguidance.hf
import msgspec
import pytest
from llguidance import LLMatcher

from frontend.api_models import ChatCompletionRequest
from frontend.structured import StructuredSettings, build_constraint, forced_call_prefix
from postproc.tool_parsers import get_tool_parser
from postproc.tool_parsers.base import rebase_refs
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer

# What pydantic writes for a model with a nested model: the nested one under $defs.
PYDANTIC_SCHEMA = {
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "zip": {"$ref": "#/$defs/Zip"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "Zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "address"],
    "additionalProperties": False,
}
SHIP = {"type": "function", "function": {"name": "ship", "parameters": PYDANTIC_SCHEMA}}
SHIP_STRICT = {"type": "function", "function": {"name": "ship", "parameters": PYDANTIC_SCHEMA,
                                                "strict": True}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"$ref": "#/definitions/T"}},
    "definitions": {"T": {"type": "string", "maxLength": 8}}, "required": ["text"]}}}
GOOD = {"name": "Ann", "address": {"city": "Paris", "zip": "75001"}}
BAD_ZIP = {"name": "Ann", "address": {"city": "Paris", "zip": "7500x"}}


@pytest.fixture(scope="module")
def llt():
    return llguidance.hf.from_tokenizer(load_tokenizer(default_model_path()), eos_token=[2])


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def accepts(llt, grammar: str, text: str) -> bool:
    matcher = LLMatcher(llt, grammar, log_level=0)
    return matcher.consume_tokens(llt.tokenize_str(text)) and matcher.is_accepting()


def hermes_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def mistral_array_call(name: str, args: dict) -> str:
    """The older mistral spelling, whose arguments sit inside the call object."""
    return "[TOOL_CALLS][" + json.dumps({"name": name, "arguments": args}) + "]"


# ---------------------------------------------------------------- 1: $ref / $defs


def test_rebase_refs_moves_local_pointers_and_leaves_data_alone():
    schema = {"properties": {"a": {"$ref": "#/$defs/A"}, "const": {"$ref": "#"}},
              "$defs": {"A": {"items": {"$ref": "#/$defs/A"}}},
              "const": {"$ref": "#/not/a/ref"}, "x": {"$ref": "http://elsewhere#/a"}}
    assert rebase_refs(schema, "/properties/arguments") == {
        "properties": {"a": {"$ref": "#/properties/arguments/$defs/A"},
                       "const": {"$ref": "#/properties/arguments"}},
        "$defs": {"A": {"items": {"$ref": "#/properties/arguments/$defs/A"}}},
        "const": {"$ref": "#/not/a/ref"}, "x": {"$ref": "http://elsewhere#/a"}}


@pytest.mark.parametrize("parser, spell", [("hermes", hermes_call),
                                           ("mistral", mistral_array_call)])
@pytest.mark.parametrize("tools", [[SHIP], [SHIP, NOTE], [NOTE, SHIP]])
def test_forced_calls_follow_schemas_with_defs(llt, parser, spell, tools):
    structured = StructuredSettings(tool_call_parser=parser, tokenizer=llt)
    required = build_constraint(chat(tools=tools, tool_choice="required"), structured)
    assert accepts(llt, required.grammar, spell("ship", GOOD))
    assert not accepts(llt, required.grammar, spell("ship", BAD_ZIP))  # $ref followed
    if any(t["function"]["name"] == "note" for t in tools):
        assert accepts(llt, required.grammar, spell("note", {"text": "hi"}))
        assert not accepts(llt, required.grammar, spell("note", {"text": "x" * 9}))
    named_choice = {"type": "function", "function": {"name": "ship"}}
    request = chat(tools=tools, tool_choice=named_choice)
    named = build_constraint(request, structured)
    prefix = forced_call_prefix(request, structured)
    assert accepts(llt, named.grammar, spell("ship", GOOD)[len(prefix):])
    assert not accepts(llt, named.grammar, spell("ship", BAD_ZIP)[len(prefix):])


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_strict_tools_follow_schemas_with_defs(llt, parser):
    structured = StructuredSettings(tool_call_parser=parser, tokenizer=llt)
    strict = build_constraint(chat(tools=[SHIP_STRICT]), structured)
    assert strict is not None
    if parser == "hermes":
        assert accepts(llt, strict.grammar, "Sure. " + hermes_call("ship", GOOD))
        assert not accepts(llt, strict.grammar, "Sure. " + hermes_call("ship", BAD_ZIP))
    else:  # both mistral spellings: v11 (root schema) and the older array (nested)
        v11 = "[TOOL_CALLS]ship[ARGS]" + json.dumps(GOOD)
        array = "[TOOL_CALLS][" + json.dumps({"name": "ship", "arguments": GOOD}) + "]"
        assert accepts(llt, strict.grammar, v11) and accepts(llt, strict.grammar, array)
        bad = "[TOOL_CALLS][" + json.dumps({"name": "ship", "arguments": BAD_ZIP}) + "]"
        assert not accepts(llt, strict.grammar, bad)
    jsonschema.validate(GOOD, PYDANTIC_SCHEMA)  # the test's call is right by the schema


def test_hermes_parses_what_the_defs_grammar_allows():
    text = hermes_call("ship", GOOD)
    parsed = get_tool_parser("hermes")([SHIP]).parse(text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("ship", GOOD)]


# ---------------------------------------------------------------- 15: bounded numbers


def json_constraint(llt, **fields):
    structured = StructuredSettings(tool_call_parser="hermes", tokenizer=llt)
    return build_constraint(chat(**fields), structured).grammar


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


SIXTEEN, SEVENTEEN = "1" * 16, "1" * 17


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"json_object": True}},
    {"response_format": schema_format({"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": ["number", "null"]}}})},
    {"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0},
                                                     "x": {"type": "number", "maximum": 5}}}},
])
def test_json_numbers_get_at_most_16_integral_and_10_fraction_digits(llt, fields):
    grammar = json_constraint(llt, **fields)
    assert accepts(llt, grammar, f'{{"n": {SIXTEEN}, "x": -{"1" * 15}.0123456789}}')
    assert not accepts(llt, grammar, f'{{"n": {SEVENTEEN}}}')
    assert not accepts(llt, grammar, f'{{"n": -{SEVENTEEN}}}')
    assert not accepts(llt, grammar, '{"n": 1, "x": 0.01234567891}')  # 11 fraction digits
    assert not accepts(llt, grammar, '{"n": 1e20}')  # nor an exponent


def test_a_schemas_own_bounds_and_step_win(llt):
    grammar = json_constraint(llt, response_format=schema_format({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 1e20},
        "x": {"type": "number", "multipleOf": 0.5}}}))
    assert accepts(llt, grammar, f'{{"n": {"9" * 18}, "x": 1.5}}')
    assert not accepts(llt, grammar, f'{{"n": -{SEVENTEEN}}}') and not accepts(
        llt, grammar, '{"n": 1, "x": 1.25}')


def test_forced_call_arguments_have_bounded_numbers(llt):
    counter = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    free = {"type": "function", "function": {"name": "free"}}
    grammar = json_constraint(llt, tools=[counter, free], tool_choice="required")
    assert accepts(llt, grammar, hermes_call("count", {"n": int(SIXTEEN)}))
    assert not accepts(llt, grammar, hermes_call("count", {"n": int(SEVENTEEN)}))
    assert accepts(llt, grammar, hermes_call("free", {"a": [1.5, {"b": None}], "c": "d"}))
    assert not accepts(llt, grammar, hermes_call("free", {"a": int(SEVENTEEN)}))
