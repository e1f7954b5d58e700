"""Tool-call parsers (req O-2, O-6): one-shot results, and streaming that gives the same
result however the text is split: one real token at a time (SmolLM2 tokenizer, incremental
detokenizer), one character at a time, and cut into two or three pieces at every boundary."""

from __future__ import annotations

import json
import random
import re

import msgspec
import pytest

from postproc.reasoning import get_reasoning_parser
from postproc.tool_parsers import (
    TOOL_PARSERS,
    ToolDelta,
    collect,
    get_tool_parser,
)
from postproc.tool_parsers.qwen3_coder import convert_value
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer
from shared.tool_specs import ChatTool, FunctionDefinition
from tests.unit.parser_builders import token_pieces

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "threshold": {"type": "number"},
                "options": {"type": "object"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "note": {"type": ["string", "null"]},
            },
            "required": ["city"],
        },
    },
}
WRITE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        },
    },
}
TOOLS = [WEATHER, WRITE]

NESTED = {"filters": {"range": [1, 2.5, {"deep": None}], "flag": True}, "tags": ["a", "b"]}
UNICODE = {"city": "東京", "note": "café ☕ naïve — 😀 \"quoted\" back\\slash"}

# (parser, output text, expected content, expected calls [(name, arguments)])
CASES: list[tuple[str, str, str | None, list[tuple[str, dict]]]] = [
    # ---- hermes ------------------------------------------------------------------------
    ("hermes", "Hello! How can I help you today?\n", "Hello! How can I help you today?\n", []),
    (
        "hermes",
        'Let me check the weather.\n\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 3}}\n</tool_call>',
        "Let me check the weather.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "hermes",
        "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": UNICODE},
                                     ensure_ascii=False)
        + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "search", "arguments": NESTED}) + "\n</tool_call>",
        None,
        [("get_weather", UNICODE), ("search", NESTED)],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        "I asked for the weather in Oslo.",
        "I asked for the weather in Oslo.",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "hermes",
        "Use the <tool> tag, or <tool_call-ish> markup; a <b and c </tool_ d <tool_",
        "Use the <tool> tag, or <tool_call-ish> markup; a <b and c </tool_ d <tool_",
        [],
    ),
    # An unfinished call whose arguments had begun streaming stays a call: see
    # tests/unit/test_parser_fidelity.py (arguments stream as they are written).
    (
        "hermes",
        "<tool_call>{not json}</tool_call> and more",
        "{not json} and more",
        [],
    ),
    (  # complete JSON, output ended before the close tag (e.g. it was a stop string)
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
        None,
        [("get_weather", {"city": "Rome"})],
    ),
    (  # a model that forgot to close the first block; a stray close tag
        "hermes",
        '<tool_call>{"name": "a", "arguments": {}}<tool_call>{"name": "b", "arguments": '
        '{"x": 1}}</tool_call></tool_call>',
        None,
        [("a", {}), ("b", {"x": 1})],
    ),
    # ---- llama3_json -------------------------------------------------------------------
    ("llama3_json", "The capital of France is Paris.", "The capital of France is Paris.", []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        "\n" + json.dumps({"name": "search", "parameters": NESTED}) + "; "
        + json.dumps({"name": "get_weather", "arguments": UNICODE}, ensure_ascii=False),
        None,
        [("search", NESTED), ("get_weather", UNICODE)],
    ),
    (
        "llama3_json",
        'Let me look that up. <|python_tag|>{"name": "get_weather", "parameters": '
        '{"city": "Lima"}}\n\nDone.',
        "Let me look that up.Done.",
        [("get_weather", {"city": "Lima"})],
    ),
    (
        "llama3_json",
        '{"answer": 42, "text": "not a call"} is the JSON you asked for.',
        '{"answer": 42, "text": "not a call"} is the JSON you asked for.',
        [],
    ),
    (
        "llama3_json",
        "{braces} are fun; <|python is not a tag <|python_ta",
        "{braces} are fun; <|python is not a tag <|python_ta",
        [],
    ),
    # (An unfinished llama3_json call whose arguments began streaming stays a call: see
    # tests/unit/test_parser_fidelity.py.)
    # ---- mistral -----------------------------------------------------------------------
    ("mistral", "Bonjour ! Comment puis-je vous aider ?", "Bonjour ! Comment puis-je vous aider ?",
     []),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "mistral",
        "Sure, checking both.[TOOL_CALLS]get_weather[ARGS]"
        + json.dumps(UNICODE, ensure_ascii=False)
        + "[TOOL_CALLS]search[ARGS]" + json.dumps(NESTED),
        "Sure, checking both.",
        [("get_weather", UNICODE), ("search", NESTED)],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "search", "arguments": ' + json.dumps(NESTED) + "}]",
        None,
        [("get_weather", {"city": "Paris"}), ("search", NESTED)],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather{"city": "Paris"} Let me know if you need more.',
        "Let me know if you need more.",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "mistral",
        "See [TOOL] and [TOOL_CALL] and [1] and [ARG",
        "See [TOOL] and [TOOL_CALL] and [1] and [ARG",
        [],
    ),
    # (An unfinished mistral `name[ARGS]{...` call stays a call once its arguments began
    # streaming: see tests/unit/test_parser_fidelity.py.)
    ("mistral", "[TOOL_CALLS]not a call, just words", "not a call, just words", []),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}\n'
        '[TOOL_CALLS]get_weather[CALL_ID]Zz9Yy8Xx7[ARGS]{"city": "Bergen"}',
        None,
        [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})],
    ),
    ("mistral", "[TOOL_CALLS]f[CALL_ID]not-alnum[ARGS]{}", "fnot-alnum{}", []),
    # ---- pythonic ----------------------------------------------------------------------
    ("pythonic", "There are 3 [citation needed] apples.",
     "There are 3 [citation needed] apples.", []),
    (
        "pythonic",
        '[get_weather(city="San Francisco", days=3, metric=True)]',
        None,
        [("get_weather", {"city": "San Francisco", "days": 3, "metric": True})],
    ),
    (
        "pythonic",
        "[search(query='日本語 \"quoted\" ] ) [', filters={\"range\": (1, 2.5, {\"deep\": None}),"
        " \"flag\": true}, limit=-10), get_time()]\nDone.",
        "Done.",
        [
            ("search", {"query": '日本語 "quoted" ] ) [',
                        "filters": {"range": [1, 2.5, {"deep": None}], "flag": True},
                        "limit": -10}),
            ("get_time", {}),
        ],
    ),
    (
        "pythonic",
        'Sure!<|python_start|>[get_weather(city="Paris")]<|python_end|>',
        "Sure!",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "pythonic",
        '[write_file(path="a.py", content="""def f():\n    return [1, \'x\']\n""")]',
        None,
        [("write_file", {"path": "a.py", "content": "def f():\n    return [1, 'x']\n"})],
    ),
    ("pythonic", "[note(this is prose)] and [1](link)", "[note(this is prose)] and [1](link)",
     []),
    ("pythonic", "[f(1, 2)]", "[f(1, 2)]", []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    # ---- qwen3_coder -------------------------------------------------------------------
    ("qwen3_coder", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    (
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n"
        "</parameter>\n<parameter=threshold>\n-2.5\n</parameter>\n<parameter=note>\nnull\n"
        "</parameter>\n</function>\n</tool_call>",
        "I'll check.",
        [("get_weather", {"city": "Paris", "days": 3, "metric": True, "threshold": -2.5,
                          "note": None})],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n東京 😀\n</parameter>\n"
        "<parameter=options>\n" + json.dumps(NESTED) + "\n</parameter>\n<parameter=hours>\n"
        "[1, 2, 3]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=content>\n"
        "def f():\n    return {'a': [1, 2]}\n\n</parameter>\n</function>\n</tool_call>\n"
        "Both done.",
        "Both done.",
        [
            ("get_weather", {"city": "東京 😀", "options": NESTED, "hours": [1, 2, 3]}),
            ("write_file", {"path": "src/a.py", "content": "def f():\n    return {'a': [1, 2]}\n"}),
        ],
    ),
    (  # unknown tool: no schema, values stay strings; bad integer stays a string
        "qwen3_coder",
        "<tool_call>\n<function=lookup>\n<parameter=id>\n42\n</parameter>\n</function>\n"
        "</tool_call><tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n"
        "</parameter>\n</function>\n</tool_call>",
        None,
        [("lookup", {"id": "42"}), ("get_weather", {"days": "three"})],
    ),
    (
        "qwen3_coder",
        "Tags like <tool> or <function=x> or <tool_call and <parameter=y> are just text <tool_ca",
        "Tags like <tool> or <function=x> or <tool_call and <parameter=y> are just text <tool_ca",
        [],
    ),
    (
        "qwen3_coder",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "Checking.\n\n<function=get_weather>\n<parameter=city>\nPar",
        [],
    ),
    (  # complete function, output ended before </tool_call>
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "</function>\n",
        None,
        [("get_weather", {"city": "Rome"})],
    ),
]

CASE_IDS = [f"{i}-{case[0]}" for i, case in enumerate(CASES)]
CALL_ID = {"mistral": re.compile(r"[A-Za-z0-9]{9}")}
DEFAULT_CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def stream(parser_name: str, pieces: list[str], tools=TOOLS) -> list[ToolDelta]:
    parser = get_tool_parser(parser_name)(tools)
    return [parser.feed(p) for p in pieces] + [parser.finish()]


def streamed_result(parser_name: str, deltas: list[ToolDelta]):
    """Checks the delta shapes; returns (content, [(id, name, arguments text)])."""
    id_re = CALL_ID.get(parser_name, DEFAULT_CALL_ID)
    calls: list[list[str]] = []
    for delta in deltas:
        for c in delta.calls:
            if c.index == len(calls):  # the first delta of a new call
                assert c.type == "function" and c.function.name
                assert c.id is not None and id_re.fullmatch(c.id), c.id
                calls.append([c.id, c.function.name, c.function.arguments or ""])
            else:
                assert c.index == len(calls) - 1, "deltas of an earlier call, or a skipped index"
                assert c.id is None and c.type is None and c.function.name is None
                calls[-1][2] += c.function.arguments or ""
    content = "".join(d.content for d in deltas)
    return content, calls


def check_stream(parser_name: str, pieces: list[str], content, calls) -> None:
    got_content, got_calls = streamed_result(parser_name, stream(parser_name, pieces))
    assert got_content == (content or ""), pieces
    assert [(name, json.loads(args)) for _, name, args in got_calls] == calls, pieces
    for delimiter in get_tool_parser(parser_name).delimiters:
        assert delimiter not in got_content


def splits(text: str):
    """Every cut into two pieces, and three pieces at every position with short middles."""
    n = len(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
        for width in (1, 2, 3, 5, 8, 13):
            if i + width <= n:
                yield [text[:i], text[i:i + width], text[i + width:]]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_one_shot(case):
    name, text, content, calls = case
    parsed = get_tool_parser(name)(TOOLS).parse(text)
    assert parsed.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == calls
    assert all(c.type == "function" for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_streaming_token_by_token(case, tokenizer):
    name, text, content, calls = case
    check_stream(name, token_pieces(tokenizer, text), content, calls)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_streaming_every_split(case):
    name, text, content, calls = case
    check_stream(name, list(text), content, calls)  # one character at a time
    for pieces in splits(text):
        check_stream(name, pieces, content, calls)


def test_plain_text_is_untouched():
    text = "  Leading spaces, a <tag>, [brackets], {braces}; and trailing newlines\n\n"
    for name in TOOL_PARSERS:
        assert get_tool_parser(name)([]).parse(text).content == text, name


def test_nothing_undecided_is_streamed():
    """A possible call start is held until decided, then released as content or as a call."""
    parser = get_tool_parser("hermes")([])
    assert parser.feed("Hi <tool").content == "Hi"  # " <tool" might start a call
    assert parser.feed("box> there").content == " <toolbox> there"
    parser = get_tool_parser("hermes")([])
    assert parser.feed("<tool_call>").content == ""
    assert parser.feed('{"name": "f", "argu') == ToolDelta()  # the head is undecided
    head = parser.feed('ments": {"a": ')  # then the header, and arguments as written
    assert [c.function.name for c in head.calls if c.id] == ["f"]
    assert "".join(c.function.arguments or "" for c in head.calls) == '{"a": '
    done = parser.feed("1}}</tool_call>")
    assert [c.function.arguments for c in done.calls] == ["1}"] and done.content == ""
    assert parser.finish() == ToolDelta()


def test_delta_shape_is_openai():
    parser = get_tool_parser("hermes")([], call_id_seed="req-1")
    delta = parser.feed('<tool_call>{"name": "f", "arguments": {"a": "é"}}</tool_call>')
    first, second = (msgspec.json.decode(msgspec.json.encode(c)) for c in delta.calls)
    assert first == {"index": 0, "id": first["id"], "type": "function",
                     "function": {"name": "f", "arguments": ""}}
    assert second == {"index": 0, "function": {"arguments": '{"a": "é"}'}}
    assert list(first) == ["index", "id", "type", "function"]


def test_call_ids_from_seed_are_stable():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2
    a = get_tool_parser("hermes")([], call_id_seed="req-7").parse(text)
    b = get_tool_parser("hermes")([], call_id_seed="req-7").parse(text)
    c = get_tool_parser("hermes")([], call_id_seed="req-8").parse(text)
    assert [x.id for x in a.calls] == [x.id for x in b.calls]
    assert a.calls[0].id != a.calls[1].id and a.calls[0].id != c.calls[0].id
    assert all(DEFAULT_CALL_ID.fullmatch(x.id) for x in a.calls)
    m = get_tool_parser("mistral")([], call_id_seed="req-7").parse(
        '[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[CALL_ID]Abc123xyZ[ARGS]{}')
    assert CALL_ID["mistral"].fullmatch(m.calls[0].id) and m.calls[1].id == "Abc123xyZ"


def test_parse_leaves_the_streaming_state_alone():
    parser = get_tool_parser("hermes")([])
    parser.feed("Hello <tool_")
    assert parser.parse('<tool_call>{"name": "g", "arguments": {}}</tool_call>').calls
    assert parser.feed("call>").content == ""
    rest = parser.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert [c.function.name for c in rest.calls if c.id] == ["f"]


def test_collect_matches_one_shot():
    text = 'x<tool_call>{"name": "f", "arguments": {"a": [1]}}</tool_call>y'
    deltas = stream("hermes", list(text))
    parsed = collect(deltas)
    assert parsed.content == "xy" and parsed.calls[0].function.arguments == '{"a": [1]}'


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "openai", "pythonic",
                                 "qwen3_coder", "deepseek_v3", "deepseek_v31", "glm45",
                                 "granite", "kimi_k2", "llama4_json", "llama4_pythonic"}
    with pytest.raises(ValueError, match="^unknown tool-call parser 'nope'; known: deepseek_v3, "
                                         "deepseek_v31, glm45, granite, hermes, kimi_k2, "
                                         "llama3_json, llama4_json, llama4_pythonic, mistral, "
                                         "openai, pythonic, qwen3_coder$"):
        get_tool_parser("nope")


def test_tools_as_structs_or_their_json():
    """The frontend's ChatTools or the dicts the postproc step decodes: the same tools."""
    function = FunctionDefinition(name="f", parameters={"properties": {"n": {"type": "integer"}}})
    text = "<tool_call><function=f><parameter=n>7</parameter></function></tool_call>"
    typed = [ChatTool(function=function)]
    for tools in (typed, msgspec.to_builtins(typed)):
        parsed = get_tool_parser("qwen3_coder")(tools).parse(text)
        assert json.loads(parsed.calls[0].function.arguments) == {"n": 7}


@pytest.mark.parametrize("odd", [{"type": "function"}, {"type": "other", "function": {"name": "g"}},
                                 {"type": "function", "function": {"name": 5}}])
def test_an_entry_that_is_no_tool_is_an_error_not_dropped(odd):
    """Issue 40: the frontend refuses such tools; past it, nothing drops one silently."""
    tool = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ValueError):
        get_tool_parser("hermes")([tool, odd])


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("5", {"type": "integer"}, 5),
        ("5.0", {"type": "number"}, 5.0),
        ("1e3", {"type": "number"}, 1000.0),
        ("x", {"type": "number"}, "x"),
        ("FALSE", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": "integer"}, None),
        ("null", {"type": "string"}, "null"),
        ("null", {"type": ["string", "null"]}, None),
        ("{'a': True}", {"type": "object"}, {"a": True}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("b", {"enum": ["a", "b"]}, "b"),
        ("2", {"enum": [1, 2]}, 2),
        ("3", {"type": "int"}, 3),
        ("42", None, "42"),
        (" spaced ", {"type": "string"}, " spaced "),
    ],
)
def test_qwen3_coder_value_types(value, schema, expected):
    got = convert_value(value, schema)
    assert got == expected and type(got) is type(expected)


# -- reasoning first, then tool calls: how the pipeline will chain them ---------------------


def chained(pieces: list[str], prompt: str):
    reasoning_parser = get_reasoning_parser("qwen3")(prompt)
    tool_parser = get_tool_parser("hermes")(TOOLS)
    reasoning, deltas = [], []
    for piece in pieces + [None]:
        r = reasoning_parser.feed(piece) if piece is not None else reasoning_parser.finish()
        reasoning.append(r.reasoning)
        deltas.append(tool_parser.feed(r.content))
    deltas.append(tool_parser.finish())
    return "".join(reasoning), deltas


def test_reasoning_then_tool_calls(tokenizer):
    prompt = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    text = (
        "<think>\nThe user wants the weather. I could write <tool_call> here but I am still "
        "thinking.\n</think>\n\nLet me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    for pieces in [token_pieces(tokenizer, text), list(text)]:
        reasoning, deltas = chained(pieces, prompt)
        assert reasoning.startswith("The user wants") and reasoning.endswith("still thinking.")
        content, calls = streamed_result("hermes", deltas)
        assert content == "Let me check."
        assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris"})]



# -- a forced call's opening injected after the prompt (req C-3) ---------------------------

PREFILL_CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ',
     '{"city": "Paris", "days": 2}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris", "days": 2})]),
    ("hermes", "<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Nice"}}'
     "\n</tool_call>\nThat's all.", "That's all.", [("get_weather", {"city": "Nice"})]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]", '{"city": "Paris"}', None,
     [("get_weather", {"city": "Paris"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n",
     "<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"days": 5})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": ', '"Pa"}}',
     None, [("get_weather", {"city": "Pa"})]),  # the prefill opened the arguments
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_prefill(case):
    name, prefill, text, content, calls = case
    cls = get_tool_parser(name)
    parsed = cls(TOOLS, prefill=prefill).parse(text)
    assert parsed.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == calls
    for pieces in [list(text), *splits(text)]:
        parser = cls(TOOLS, prefill=prefill)
        got_content, got_calls = streamed_result(
            name, [parser.feed(p) for p in pieces] + [parser.finish()])
        assert got_content == (content or "")
        assert [(n, json.loads(a)) for _, n, a in got_calls] == calls


# -- any text, any split: the same result ---------------------------------------------------

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool", "_call>", "</", "{", "}", "[", "]", "(", ")", '"',
    "'", "\\", ";", " ", "\n", "#", '"""', "é😀", "hello", "f", "get_x", "1", ",", "abc123XYZ",
    '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "parameters": {}}',
    '{"x": [1, "]"]}', "[f(a=1)]", "f(a=1)", "g()", "<|python_tag|>", "<|python_start|>",
    "<|python_end|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<function=f>", "</function>",
    "<parameter=a>", "</parameter>",
]


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
def test_random_text_is_split_invariant(parser_name):
    rng = random.Random(parser_name)
    cls = get_tool_parser(parser_name)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        parser = cls([])
        want = streamed_result(parser_name, [parser.feed(text), parser.finish()])
        for _ in range(3):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            parser = cls([])
            got = streamed_result(parser_name, [parser.feed(p) for p in pieces]
                                  + [parser.finish()])
            assert [got[0], [c[1:] for c in got[1]]] == [want[0], [c[1:] for c in want[1]]], (
                text, pieces)
            for delimiter in cls.delimiters:
                assert delimiter not in got[0], (text, pieces)
