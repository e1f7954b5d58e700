"""Forced tool calls for the mistral, pythonic and qwen3_coder parsers (req C-1 to C-3).

Each parser spells its call syntax as a grammar (`call_grammar` and the marker fields); the
frontend turns it into the required / named / strict grammars. The checks run llguidance
matchers on the real SmolLM2 tokenizer: a known-valid call is accepted and parsed back by the
parser into exactly the call that was written, a wrong tool name or a wrong type is rejected,
and outputs sampled at random from the grammar's token masks parse into calls whose arguments
validate against the tool's schema.
"""

import copy
import json
import random

import jsonschema
import llguidance.hf
import msgspec
import numpy as np
import pytest
from llguidance import LLMatcher, grammar_from

from frontend.base.api_models import ChatCompletionRequest
from frontend.base.errors import APIError
from frontend.input.structured import StructuredSettings, build_constraint, forced_call_prefix
from frontend.pipeline.sampling import check_request, plan_request
from postproc.reasoning import REASONING_PARSERS, get_reasoning_parser
from postproc.tool_parsers import get_tool_parser
from postproc.tool_parsers.base import collect
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PARSERS = ("mistral", "pythonic", "qwen3_coder")
# The think-tag reasoning parsers; openai_gptoss pairs with the Harmony tool parser only
# (tests/unit/test_harmony_grammars.py); deepseek_v3 and glm45 are qwen3's machine under
# other names, and granite's tags are sentences (tests/unit/test_family_grammars.py).
THINK_TAG_PARSERS = sorted(set(REASONING_PARSERS)
                           - {"openai_gptoss", "deepseek_v3", "glm45", "granite"})

ARGS = {"city": "Paris", "days": 3, "units": "celsius", "tags": ["a", "b"], "note": None}


def spell(parser: str, name: str, args: dict) -> str:
    """One call of `name` as the parser's format writes it (begin marker included)."""
    if parser == "mistral":
        return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}"
    if parser == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
    if parser == "pythonic":
        def py(v):
            return {True: "True", False: "False", None: "None"}.get(v, v) \
                if isinstance(v, bool) or v is None else \
                "[" + ", ".join(py(x) for x in v) + "]" if isinstance(v, list) else json.dumps(v)
        return f"[{name}(" + ", ".join(f"{k}={py(v)}" for k, v in args.items()) + ")]"

    def raw(v):
        return v if isinstance(v, str) else json.dumps(v)
    body = "".join(f"<parameter={k}>\n{raw(v)}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def join(parser: str, calls: list[str]) -> str:
    if parser == "pythonic":  # one list: [f(...), g(...)]
        return "[" + ", ".join(c[1:-1] for c in calls) + "]"
    return ("\n" if parser == "qwen3_coder" else "").join(calls)


@pytest.fixture(scope="module")
def llt():
    return llguidance.hf.from_tokenizer(load_tokenizer(default_model_path()), eos_token=[2])


def settings(llt, parser: str) -> StructuredSettings:
    return StructuredSettings(tool_call_parser=parser, tokenizer=llt)


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def constraint(request, structured):
    check_request(request, structured)
    plan = plan_request(request, endpoint="chat", prompt_len=4, max_model_len=64,
                        vocab_size=49152,
                        constraint=build_constraint(request, structured))
    return plan.params.constraint


def accepts(llt, grammar: str, text: str) -> bool:
    matcher = LLMatcher(llt, grammar, log_level=0)
    return matcher.consume_tokens(llt.tokenize_str(text)) and matcher.is_accepting()


def parsed(parser: str, text: str, tools=(WEATHER, TIME), prefill: str = ""):
    result = get_tool_parser(parser)(list(tools), prefill=prefill).parse(text)
    return result.content, [(c.function.name, json.loads(c.function.arguments))
                            for c in result.calls]


@pytest.mark.parametrize("parser", PARSERS)
def test_required_accepts_valid_calls_and_the_parser_reads_them_back(llt, parser):
    c = constraint(chat(tools=[WEATHER, TIME], tool_choice="required"), settings(llt, parser))
    one = spell(parser, "get_weather", ARGS)
    two = join(parser, [one, spell(parser, "get_time", {"x": "1"})])
    for text, calls in ((one, [("get_weather", ARGS)]),
                        (two, [("get_weather", ARGS), ("get_time", {"x": "1"})])):
        assert accepts(llt, c.grammar, text), text
        assert parsed(parser, text) == (None, calls)
    assert not accepts(llt, c.grammar, "Sure! " + one)  # nothing before the calls
    assert not accepts(llt, c.grammar, "")  # at least one call
    once = constraint(chat(tools=[WEATHER, TIME], tool_choice="required",
                           parallel_tool_calls=False), settings(llt, parser))
    assert accepts(llt, once.grammar, one) and not accepts(llt, once.grammar, two)


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("change", [
    {"name": "get_wether"},  # not a tool
    {"args": {"city": 3}},  # wrong type
    {"args": {"city": "Paris", "days": 30}},  # out of bounds
    {"args": {"city": "Paris", "days": "3x"}},
    {"args": {"city": "Paris", "units": "kelvin"}},  # not in the enum
    {"args": {"city": "Paris", "hourly": "yes"}},
    {"args": {"days": 3}},  # a required parameter missing
    {"args": {"city": "Paris", "zip": "75001"}},  # not a declared parameter
    {"args": {"city": "Paris", "tags": ["a", "b", "c", "d"]}},  # too many items
])
def test_required_rejects_wrong_names_and_types(llt, parser, change):
    c = constraint(chat(tools=[WEATHER, TIME], tool_choice="required"), settings(llt, parser))
    text = spell(parser, change.get("name", "get_weather"), change.get("args", {"city": "X"}))
    if parser == "qwen3_coder" and change == {"args": {"city": 3}}:
        # Raw values: the text 3 in a string parameter is the string "3", not a wrong type.
        assert accepts(llt, c.grammar, text)
        assert parsed(parser, text) == (None, [("get_weather", {"city": "3"})])
        return
    assert not accepts(llt, c.grammar, text), text


@pytest.mark.parametrize("parser", PARSERS)
def test_named_tool_choice_injects_the_marker_and_constrains_the_rest(llt, parser):
    structured = settings(llt, parser)
    request = chat(tools=[WEATHER, TIME], tool_choice=NAMED)
    prefix = forced_call_prefix(request, structured)
    assert prefix == get_tool_parser(parser).begin_marker
    c = constraint(request, structured)
    full = spell(parser, "get_weather", {"city": "Rome", "days": 2})
    assert full.startswith(prefix)
    rest = full[len(prefix):]
    assert accepts(llt, c.grammar, rest)
    assert not accepts(llt, c.grammar, spell(parser, "get_time", {})[len(prefix):])
    assert not accepts(llt, c.grammar, join(parser, [full, full])[len(prefix):])  # just one
    # The output continues the injected marker: the parser, given it as prefill, reads the call.
    assert parsed(parser, rest, prefill=prefix) == (
        None, [("get_weather", {"city": "Rome", "days": 2})])


@pytest.mark.parametrize("parser", PARSERS)
def test_strict_tools_constrain_calls_and_leave_text_free(llt, parser):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    c = constraint(chat(tools=[strict, TIME]), settings(llt, parser))
    assert c.kind == "tools"
    good = spell(parser, "get_weather", {"city": "X", "days": 1})
    assert accepts(llt, c.grammar, "Just text, no call.")
    assert accepts(llt, c.grammar, good)
    assert not accepts(llt, c.grammar, spell(parser, "get_weather", {"city": "X", "days": 0}))
    assert not accepts(llt, c.grammar, spell(parser, "get_wether", {"city": "X"}))
    if parser == "pythonic":  # calls only open the output; a list that is not one is refused
        assert accepts(llt, c.grammar, good + " Done.")
        assert accepts(llt, c.grammar, "See [1] and [get_weather(city=2)].")
        assert not accepts(llt, c.grammar, "[1, 2] is a list")
    else:
        assert accepts(llt, c.grammar, "Let me look. " + good + " Done.")


def test_mistral_names_its_special_tokens_by_id():
    # A vocabulary where [TOOL_CALLS] and [ARGS] are special tokens, as in Mistral's.
    hf = copy.deepcopy(load_tokenizer(default_model_path()))
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    llt = llguidance.hf.from_tokenizer(hf, eos_token=[2])
    bot, args = hf.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    spelled = get_tool_parser("mistral").for_vocabulary(llt)
    assert spelled.begin_lark == f"<[{bot}]>" and spelled.args_lark == f"<[{args}]>"
    assert spelled.name == "mistral" and spelled.begin_marker == "[TOOL_CALLS]"
    assert get_tool_parser("mistral").for_vocabulary(None) is get_tool_parser("mistral")
    structured = settings(llt, "mistral")
    c = constraint(chat(tools=[WEATHER], tool_choice="required"), structured)
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'
    tokens = llt.tokenize_str(text)
    assert tokens[0] == bot and args in tokens
    matcher = LLMatcher(llt, c.grammar, log_level=0)
    assert matcher.consume_tokens(tokens) and matcher.is_accepting()
    # The text spelled out in ordinary tokens is not the special token.
    spelled_out = llt.tokenize_str("[TOOL") + llt.tokenize_str("_CALLS]get_weather")
    assert not LLMatcher(llt, c.grammar, log_level=0).consume_tokens(spelled_out)
    # Strict tools: free text can never hold the special token, so calls open with it.
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    c = constraint(chat(tools=[strict]), structured)
    matcher = LLMatcher(llt, c.grammar, log_level=0)
    assert matcher.consume_tokens(llt.tokenize_str("Checking. ") + tokens)


def test_mistral_also_offers_the_older_array_spelling(llt):
    c = constraint(chat(tools=[WEATHER], tool_choice="required"), settings(llt, "mistral"))
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    assert accepts(llt, c.grammar, text)
    assert parsed("mistral", text) == (None, [("get_weather", {"city": "Oslo"})])
    assert not accepts(llt, c.grammar, text.replace('"Oslo"', "5"))


UNION_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object",
    "properties": {
        "v": {"type": ["string", "integer", "null"]},
        "o": {"anyOf": [{"type": "string"}, {"type": "object",
                                              "properties": {"k": {"type": "integer"}}}]},
    },
    "required": ["v"], "additionalProperties": False}}}


@pytest.mark.parametrize("value, expected, ok", [
    ("hello", "hello", True),
    ("42", 42, True),
    ("null", None, True),
    ("4 2", "4 2", True),
    (" 42", None, False),  # would read back as 42, not the string " 42": refused
    ("true", "true", True),  # booleans are not allowed here, so it stays a string
])
def test_qwen3_coder_unions_with_strings_read_back_as_written(llt, value, expected, ok):
    c = constraint(chat(tools=[UNION_TOOL], tool_choice="required"),
                   settings(llt, "qwen3_coder"))
    text = spell("qwen3_coder", "f", {"v": value})
    assert accepts(llt, c.grammar, text) == ok
    if ok:
        assert parsed("qwen3_coder", text, tools=[UNION_TOOL]) == (None, [("f", {"v": expected})])
    obj = spell("qwen3_coder", "f", {"v": "x", "o": '{"k": 1}'})
    assert accepts(llt, c.grammar, obj)
    assert parsed("qwen3_coder", obj, tools=[UNION_TOOL])[1] == [("f", {"v": "x", "o": {"k": 1}})]
    assert not accepts(llt, c.grammar, obj.replace('{"k": 1}', '{"k": "1"}'))


def test_pythonic_spells_python_literals(llt):
    c = constraint(chat(tools=[WEATHER], tool_choice="required"), settings(llt, "pythonic"))
    text = ("[get_weather(city='Pa\\'ris \\u00e9', days=14, hourly=False, tags=[\"x\"], "
            "note=None)]")
    assert accepts(llt, c.grammar, text)
    assert parsed("pythonic", text) == (None, [("get_weather", {
        "city": "Pa'ris é", "days": 14, "hourly": False, "tags": ["x"], "note": None})])
    # JSON spellings the parser would also read are not what the grammar writes.
    assert not accepts(llt, c.grammar, '[get_weather(city="X", hourly=false)]')
    assert not accepts(llt, c.grammar, '[get_weather(city="X", days=07)]')


@pytest.mark.parametrize("parser, name, message", [
    ("pythonic", "get-weather", "cannot spell the function name"),
    ("mistral", "get weather", "cannot spell the function name"),
    ("qwen3_coder", "a>b", "cannot spell the function name"),
])
def test_unspellable_names_are_400s(llt, parser, name, message):
    tool = {"type": "function", "function": {"name": name, "parameters": WEATHER_SCHEMA}}
    with pytest.raises(APIError) as info:
        constraint(chat(tools=[tool], tool_choice="required"), settings(llt, parser))
    assert info.value.status == 400 and message in info.value.message


@pytest.mark.parametrize("parser", ["pythonic", "qwen3_coder"])
def test_strict_schemas_with_keywords_the_format_cannot_enforce_are_400s(llt, parser):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}},
              "required": ["code"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    with pytest.raises(APIError) as info:
        constraint(chat(tools=[tool], tool_choice="required"), settings(llt, parser))
    assert "pattern" in info.value.message
    # Not strict: the keyword guides as far as the format allows (here, not at all).
    loose = {"type": "function", "function": {"name": "f", "parameters": schema}}
    c = constraint(chat(tools=[loose], tool_choice="required"), settings(llt, parser))
    assert accepts(llt, c.grammar, spell(parser, "f", {"code": "abc"}))


CLOSERS = ('"', "'", ")", "]", "}", ", ", "\n</parameter>\n", "<parameter=",
           "</function>\n</tool_call>", "</think>")


def sample(llt, grammar: str, rng: random.Random, max_tokens: int = 200) -> str | None:
    """A random output of `grammar`: allowed tokens drawn at random, the short ones more
    often, and now and then a closing piece (a quote, a bracket, a close tag) when the grammar
    allows all of it there, so that walks through free text end."""
    matcher = LLMatcher(llt, grammar, log_level=0)
    closers = [llt.tokenize_str(c) for c in CLOSERS]
    tokens: list[int] = []
    while len(tokens) < max_tokens and not matcher.is_accepting():
        if rng.random() < 0.25:
            fits = [c for c in closers if matcher.validate_tokens(c) == len(c)]
            if fits:
                chosen = rng.choice(fits)
                assert matcher.consume_tokens(chosen)
                tokens += chosen
                continue
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:llt.vocab_size]
        allowed = np.flatnonzero(mask)
        allowed = allowed[allowed != llt.eos_token]
        if len(allowed) == 0:
            break
        small = [t for t in allowed[:4000] if len(llt.decode_bytes([int(t)])) <= 2]
        token = int(rng.choice(small if small and rng.random() < 0.8 else list(allowed)))
        assert matcher.consume_token(token)
        tokens.append(token)
    return llt.decode_str(tokens) if matcher.is_accepting() else None


@pytest.mark.slow  # random walks of the masks, 3 to 5 s a parser; the fixed cases stay fast
@pytest.mark.parametrize("parser", PARSERS)
def test_sampled_outputs_parse_into_schema_valid_calls(llt, parser):
    c = constraint(chat(tools=[WEATHER, TIME], tool_choice="required"), settings(llt, parser))
    rng = random.Random(7)
    schemas = {"get_weather": WEATHER_SCHEMA, "get_time": {"type": "object"}}
    done = 0
    for _ in range(10):
        text = sample(llt, c.grammar, rng)
        if text is None:
            continue
        done += 1
        result = get_tool_parser(parser)([WEATHER, TIME]).parse(text)
        assert result.content is None and result.calls, text
        for call in result.calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        # Streaming one character at a time gives the same calls.
        streamed = get_tool_parser(parser)([WEATHER, TIME])
        pieces = [streamed.feed(ch) for ch in text] + [streamed.finish()]
        assert [(c.function.name, c.function.arguments) for c in collect(pieces).calls] == \
            [(c.function.name, c.function.arguments) for c in result.calls]
    assert done >= 5


def test_the_grammar_hooks_validate_with_grammar_from(llt):
    for parser in PARSERS:
        rules = get_tool_parser(parser).call_grammar(
            {"get_weather": WEATHER_SCHEMA}, strict=True)
        grammar = grammar_from("lark", "start: call\n" + rules)
        assert not LLMatcher.validate_grammar_with_warnings(grammar, llt)[0]


def through_parsers(reasoning: str, inside: bool, tool_parser: str, text: str):
    """(reasoning, content, calls) of `text` as the postproc step reads it."""
    thought, content = get_reasoning_parser(reasoning).starting(inside).parse(text)
    tools = get_tool_parser(tool_parser)([WEATHER]).parse(content or "")
    return thought, tools.content, [c.function.name for c in tools.calls]


@pytest.mark.parametrize("reasoning", THINK_TAG_PARSERS)
@pytest.mark.parametrize("parser", ("hermes", *PARSERS))
def test_thinking_before_a_forced_call_is_what_the_reasoning_parser_reads(llt, parser,
                                                                           reasoning):
    """Issue 40: the grammar's thinking and the reasoning parser's are one definition, so
    whatever the grammar lets through reads back as thinking (if any) and then a call. When
    the prompt did not open thinking, it opens with the start tag, so text that is not
    thinking cannot come first (it once could, as long as it might still end in the end
    tag: a small model wrote content until max_tokens). When the prompt opened it, it must
    close before the call."""
    structured = StructuredSettings(tool_call_parser=parser, reasoning_parser=reasoning,
                                    tokenizer=llt)
    request = chat(tools=[WEATHER], tool_choice="required")
    check_request(request, structured)
    call = spell(parser, "get_weather", {"city": "Oslo"})
    outside = build_constraint(request, structured, in_reasoning=False).grammar
    inside = build_constraint(request, structured, in_reasoning=True).grammar
    for grammar, is_inside, text, thought in (
            (outside, False, call, None),
            (outside, False, "<think>\nrain? <tool_call> maybe\n</think>\n\n" + call,
             "rain? <tool_call> maybe"),
            (inside, True, "Oslo, then.\n</think>\n\n" + call, "Oslo, then.")):
        assert accepts(llt, grammar, text), text
        assert through_parsers(reasoning, is_inside, parser, text) == (
            thought, None, ["get_weather"])
    for grammar, text in ((outside, "Sure. " + call),
                          (outside, "Oslo, then.\n</think>\n\n" + call),
                          (outside, "<think>\nhm\n</think>\n\nNo call."),
                          (inside, call)):
        assert not accepts(llt, grammar, text), text


@pytest.mark.slow  # random walks of the masks, 3 to 4 s a parser; the fixed cases stay fast
@pytest.mark.parametrize("reasoning", THINK_TAG_PARSERS)
def test_sampled_forced_outputs_read_back_as_calls_for_every_reasoning_parser(llt, reasoning):
    """Random walks of the token masks: every output the grammar allows is thinking (or
    none) and then a call, as the parsers read it."""
    structured = StructuredSettings(tool_call_parser="hermes", reasoning_parser=reasoning,
                                    tokenizer=llt)
    request = chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    rng = random.Random(40)
    for inside in (False, True):
        grammar = build_constraint(request, structured, in_reasoning=inside).grammar
        done = 0
        for _ in range(8):
            text = sample(llt, grammar, rng)
            if text is not None:
                done += 1
                assert through_parsers(reasoning, inside, "hermes", text)[1:] == (
                    None, ["get_weather"]), text
        assert done >= 3


@pytest.mark.parametrize("reasoning", THINK_TAG_PARSERS)
def test_before_a_forced_call_only_the_prompt_opens_thinking(reasoning):
    """deepseek_r1 reads a silent prompt's output as thinking; before a forced call the
    grammar lets thinking open only with the start tag, so the parser starts outside it
    there too (the frontend passes the same state to both)."""
    cls = get_reasoning_parser(reasoning)
    assert cls.initial_thinking("<|im_start|>assistant\n", forced_call=True) is False
    assert cls.initial_thinking("<|im_start|>assistant\n<think>\n", forced_call=True)
    assert not cls.initial_thinking("assistant\n<think>\n\n</think>\n\n", forced_call=True)
    assert cls.initial_thinking("<|im_start|>assistant\n") is cls.thinks_by_default


def test_strict_tools_and_a_response_format_are_a_400(llt):
    """Issue 17 item 11: both constrain the whole answer; neither is silently dropped."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    structured = settings(llt, "mistral")
    with pytest.raises(APIError) as refused:
        check_request(chat(tools=[strict], response_format={"type": "json_object"}), structured)
    assert refused.value.param == "response_format" and "strict tools" in refused.value.message
    check_request(chat(tools=[WEATHER], response_format={"type": "json_object"}), structured)
