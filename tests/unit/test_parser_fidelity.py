"""Output-side fidelity (issue 17): forced-call grammars over schemas with local `$ref`s,
bounded JSON numbers, unfinished forced calls, special tokens, streamed arguments, and stop
strings under min_tokens. Each test fails without its fix."""

import json

import jsonschema
import llguidance.hf
import msgspec
import pytest
from llguidance import LLMatcher

from frontend.base.api_models import ChatCompletionRequest
from frontend.input.structured import StructuredSettings, build_constraint, forced_call_prefix
from postproc.tool_parsers import get_tool_parser
from shared.grammar_parts import rebase_refs
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


# ---------------------------------------------------------------- 7: calls cut by max_tokens

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CUT = [  # (parser, output cut by max_tokens inside call markup, content before it)
    ("hermes", "Sure.\n<tool", "Sure."),
    ("hermes", "<tool_call>", None),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu', None),
    ("llama3_json", '{"name": "get_weather", "param', None),
    ("llama3_json", "Well <|python", "Well"),
    ("mistral", '[TOOL_CALLS]get_weather[ARG', None),
    ("mistral", '[TOOL_CALLS]get_wea', None),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "argu', None),
    ("pythonic", '[get_weather(city="Pa', None),
    ("pythonic", "[get_wea", None),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa", None),
    ("qwen3_coder", "Ok <tool_c", "Ok"),
]


def streamed(parser, text: str, *, truncated: bool, prefill: str = "", step: int = 1):
    p = get_tool_parser(parser)([WEATHER], call_id_seed="r", prefill=prefill)
    parts = [p.feed(text[i:i + step]) for i in range(0, len(text), step)]
    parts.append(p.finish(truncated=truncated))
    return parts


@pytest.mark.parametrize("parser, text, content", CUT)
def test_call_markup_cut_by_max_tokens_is_not_content(parser, text, content):
    parsed = get_tool_parser(parser)([WEATHER]).parse(text, truncated=True)
    assert parsed.content == content and parsed.calls == []
    for step in (1, 3, len(text)):  # streamed the same, however it was split
        parts = streamed(parser, text, truncated=True, step=step)
        assert ("".join(p.content for p in parts) or None) == content
        assert not [c for p in parts for c in p.calls]


def test_calls_before_the_cut_come_back_and_the_open_one_as_far_as_it_went():
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = get_tool_parser("hermes")([WEATHER]).parse(
        first + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci', truncated=True)
    assert parsed.content is None
    assert [c.function.arguments for c in parsed.calls] == ['{"city": "Paris"}', '{"ci']


def test_a_named_call_cut_by_max_tokens_leaves_no_raw_text():
    """The named tool_choice's injected marker is prefill; the output is the call's body."""
    parts = streamed("hermes", '\n{"name": "get_weather", "arguments": {"city": "Par',
                     truncated=True, prefill="<tool_call>")
    assert "".join(p.content for p in parts) == ""


def test_without_truncation_unfinished_markup_is_still_content():
    """A model that stopped by itself (EOS, a stop string) inside a would-be call wrote
    text, not a call in progress: nothing is lost."""
    assert get_tool_parser("hermes")([WEATHER]).parse("a <tool").content == "a <tool"
    assert get_tool_parser("hermes")([WEATHER]).parse("<tool_call>oops").content == "oops"


def run_processor(ids, params, finish=("length", None), num_before=0):
    """Feeds ids one per step, as the engine would, through the postproc step."""
    from postproc.processor import OutputProcessor
    from shared.protocol import RequestOutput, pack_ids

    tokenizer = load_tokenizer("default")
    processor = OutputProcessor(tokenizer)
    processor.register("r", [1, 2], params)
    frames = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        output = RequestOutput(
            request_id="r", new_token_ids=pack_ids([token]), num_prompt_tokens=2,
            num_output_tokens=num_before + i + 1, finish_reason=finish[0] if last else None,
            stop_reason=finish[1] if last else None)
        processed = processor.process([output])
        frames.extend(processed.frames)
        if processed.frames and processed.frames[-1].finish_reason is not None:
            break
    return frames


def test_the_postproc_step_tells_the_parser_the_output_was_cut():
    from shared.protocol import OutputParams

    tokenizer = load_tokenizer("default")
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    params = OutputParams(tool_parser="hermes", tools=json.dumps([WEATHER]).encode())
    frames = run_processor(tokenizer.encode(text, add_special_tokens=False), params)
    assert "".join(f.text for f in frames) == "Sure."
    assert frames[-1].finish_reason == "length"


# ---------------------------------------------------------------- 12: special delimiters


@pytest.fixture(scope="module")
def special_tokenizer():
    """SmolLM2's tokenizer with hermes' tags made special tokens, as Mistral's
    [TOOL_CALLS] or Llama's <|python_tag|> are in theirs."""
    tok = load_tokenizer(default_model_path())
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    return tok


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run_with(tok, ids, params, finish=("stop", None)):
    from postproc.processor import OutputProcessor
    from shared.protocol import RequestOutput, pack_ids

    processor = OutputProcessor(tok)
    processor.register("r", [1, 2], params)
    frames = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        processed = processor.process([RequestOutput(
            request_id="r", new_token_ids=pack_ids([token]), num_prompt_tokens=2,
            num_output_tokens=i + 1, finish_reason=finish[0] if last else None,
            stop_reason=finish[1] if last else None)])
        frames.extend(processed.frames)
    return frames


@pytest.mark.parametrize("skip", [True, False])
def test_special_delimiters_reach_the_parser_and_other_special_tokens_follow_skip(
        special_tokenizer, skip):
    from postproc.processor import special_ids_to_skip
    from shared.protocol import OutputParams

    tok = special_tokenizer
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = "<|im_start|>Sure.<file_sep> " + call
    assert tok.convert_tokens_to_ids("<tool_call>") in ids_of(tok, text)  # one special token
    params = OutputParams(skip_special_tokens=skip, tool_parser="hermes",
                          tools=json.dumps([WEATHER]).encode())
    frames = run_with(tok, ids_of(tok, text), params)
    content = "".join(f.text for f in frames)
    calls = [c for f in frames for c in f.tool_calls]
    assert calls and calls[0].function.name == "get_weather"
    # Skipped as asked: the other special tokens are gone; kept when asked, they stay.
    assert content == ("Sure." if skip else "<|im_start|>Sure.<file_sep>")
    assert frames[-1].finish_reason == "tool_calls"
    keep = special_ids_to_skip(tok, None, "hermes")
    assert tok.convert_tokens_to_ids("<tool_call>") not in keep
    assert tok.convert_tokens_to_ids("<|im_start|>") in keep
    assert special_ids_to_skip(load_tokenizer(default_model_path()), None, "hermes") is None


def test_without_parsers_special_tokens_are_skipped_as_before(special_tokenizer):
    from shared.protocol import OutputParams

    tok = special_tokenizer
    frames = run_with(tok, ids_of(tok, "a<tool_call>b<|im_start|>c"), OutputParams(),
                      finish=("length", None))
    assert "".join(f.text for f in frames) == "abc"


# ---------------------------------------------------------------- 14: arguments stream


def arguments_so_far(parser, pieces):
    """Feeds pieces one by one; returns (calls' headers, arguments text after each piece)."""
    headers, args, after = [], {}, []
    for piece in pieces:
        for c in parser.feed(piece).calls:
            if c.id is not None:
                headers.append((c.index, c.function.name, c.function.arguments))
            else:
                args[c.index] = args.get(c.index, "") + c.function.arguments
        after.append(dict(args))
    return headers, args, after


def test_hermes_arguments_stream_as_the_model_writes_them():
    tok = load_tokenizer(default_model_path())
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": [1, 2], "note": "a \\"b\\" }"}}\n</tool_call>')
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode(ids[:i + 1])[len(tok.decode(ids[:i])):] for i in range(len(ids))]
    headers, args, after = arguments_so_far(get_tool_parser("hermes")([WEATHER]), pieces)
    assert headers == [(0, "get_weather", "")]
    final = '{"city": "Paris", "days": [1, 2], "note": "a \\"b\\" }"}'
    assert args == {0: final}
    seen = [a.get(0, "") for a in after]
    assert len(set(seen)) > 5  # many fragments, not one at the end
    assert all(final.startswith(s) for s in seen)  # each a piece that cannot change
    # The arguments were out before the call was: "Paris" went out while "days" was written.
    cut = text.index('"days"')
    _, early, _ = arguments_so_far(get_tool_parser("hermes")([WEATHER]), [text[:cut]])
    assert early == {0: '{"city": "Paris", '}


STREAM_CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>\n<tool_call>{"name": "get_weather", "parameters": {}}</tool_call>'
               " Done.", "Done.", ['{"city": "Paris"}', "{}"]),
    # Another key order, or arguments given as a string: read whole, as before.
    ("hermes", '<tool_call>{"arguments": {"city": "Nice"}, "name": "get_weather"}</tool_call>',
     None, ['{"city": "Nice"}']),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'
               "</tool_call>", None, ['{"city": "Rome"}']),
    # Keys after the arguments, and the missing close tag: markup, not content.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}, "x": 1}',
     None, ['{"city": "Oslo"}']),
    # A tag inside the arguments ends the block (as it always has): the call stays as it went.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b',
     "b", ['{"city": "a']),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Quito", "n": {"a": 1}}}',
     None, ['{"city": "Lima"}', '{"city": "Quito", "n": {"a": 1}}']),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Li', None, ['{"city": "Li']),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "Checking.",
     ['{"city": "Par']),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_weather'
                '[CALL_ID]a1B2c3D4e[ARGS]{"city": "Rome", "d": [1]} Done.', "Done.",
     ['{"city": "Oslo"}', '{"city": "Rome", "d": [1]}']),
    # The older array spelling is still read whole.
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Bern"}}]', None,
     ['{"city": "Bern"}']),
]


def splits(text: str):
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        for width in (1, 2, 5):
            if i + width <= len(text):
                yield [text[:i], text[i:i + width], text[i + width:]]


@pytest.mark.parametrize("parser, text, content, arguments", STREAM_CASES)
def test_streamed_arguments_equal_the_one_shot_result(parser, text, content, arguments):
    parsed = get_tool_parser(parser)([WEATHER], call_id_seed="s").parse(text)
    assert parsed.content == content
    assert [c.function.arguments for c in parsed.calls] == arguments
    for pieces in [list(text), *splits(text)]:
        p = get_tool_parser(parser)([WEATHER], call_id_seed="s")
        deltas = [p.feed(x) for x in pieces] + [p.finish()]
        from postproc.tool_parsers.base import collect
        assert collect(deltas) == parsed, pieces
        for d in deltas:  # a header first, then fragments of that call only
            for c in d.calls:
                assert (c.id is None) == (c.function.name is None)


def test_the_prefill_may_open_the_arguments():
    prefill = '<tool_call>\n{"name": "get_weather", "arguments": '
    p = get_tool_parser("hermes")([WEATHER], prefill=prefill)
    first = p.feed('{"city"')
    assert [(c.function.name, c.function.arguments) for c in first.calls] == [
        ("get_weather", ""), (None, '{"city"')]


# ---------------------------------------------------------------- 8: stop strings, min_tokens


def test_a_gated_stop_string_does_not_match_but_one_ending_later_does():
    from postproc.stop_strings import StopMatcher

    m = StopMatcher(["\n", "END"], include_stop=False)
    out, matched = m.feed("a\nbE", gated=True)
    assert matched is None and out == "a\n"  # "bE" is held: it may hold the start of "END"
    out2, matched = m.feed("ND and\n")  # "END" began in gated text and ends now: it counts
    assert matched == "END" and out + out2 == "a\nb"
    m = StopMatcher(["\n"], include_stop=True)
    assert m.feed("x\ny", gated=True) == ("x\ny", None)
    assert m.feed("z\nw") == ("z\n", "\n")


def test_stop_strings_wait_for_min_tokens_in_the_postproc_step():
    from shared.protocol import OutputParams

    tokenizer = load_tokenizer("default")
    ids = tokenizer.encode("one\ntwo\nthree\nfour", add_special_tokens=False)
    newline_ids = [i for i, t in enumerate(ids) if "\n" in tokenizer.decode([t])]
    early = run_processor(ids, OutputParams(stop=["\n"]))
    assert "".join(f.text for f in early) == "one" and early[-1].stop_reason == "\n"
    # min_tokens past the first newline: the first stop string that counts is the next one.
    gated = newline_ids[0] + 1
    later = run_processor(ids, OutputParams(stop=["\n"], min_tokens=gated))
    assert "".join(f.text for f in later) == "one\ntwo"
    assert (later[-1].finish_reason, later[-1].stop_reason) == ("stop", "\n")
    # Several tokens per frame, straddling the gate: the same answer.
    from postproc.processor import OutputProcessor
    from shared.protocol import RequestOutput, pack_ids

    processor = OutputProcessor(tokenizer)
    processor.register("r", [1, 2], OutputParams(stop=["\n"], min_tokens=gated))
    frame = processor.process([RequestOutput(
        request_id="r", new_token_ids=pack_ids(ids), num_prompt_tokens=2,
        num_output_tokens=len(ids))]).frames[0]
    assert frame.text == "one\ntwo" and frame.stop_reason == "\n"


def test_mistral_arguments_stream_after_args_marker():
    p = get_tool_parser("mistral")([WEATHER])
    d = p.feed('Ok.[TOOL_CALLS]get_weather[ARGS]{"city": "Pa')
    assert d.content == "Ok."
    assert [(c.function.name, c.function.arguments) for c in d.calls] == [
        ("get_weather", ""), (None, '{"city": "Pa')]
    assert [c.function.arguments for c in p.feed('ris"}').calls] == ['ris"}']
