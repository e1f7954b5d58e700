"""Issue 52's parsers (deepseek_v3, deepseek_v31, kimi_k2, glm45, granite, llama4_pythonic,
llama4_json; reasoning deepseek_v3, glm45, granite, kimi_k2) on outputs in each family's real
format, as their published chat templates write an assistant turn: one-shot, one token at a
time (SmolLM2 tokenizer), one character at a time, and cut at every position (so every
marker is split at every point), always the same result; arguments stream as written."""

from __future__ import annotations

import json
import random
import re

import pytest

from postproc.reasoning import get_reasoning_parser
from postproc.tool_parsers import get_tool_parser
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer
from tests.unit.parser_builders import token_pieces
from tests.unit.test_tool_parsers import splits

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "hours": {"type": "array", "items": {"type": "integer"}},
                   "note": {"type": ["string", "null"]}},
    "required": ["city"]}}}
TOOLS = [WEATHER]

# DeepSeek's markers: full-width bars and U+2581.
DS_B, DS_E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CB, DS_CE, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
K_B, K_E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CB, K_AB, K_CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def v3_call(name: str, args: str) -> str:
    return f"{DS_CB}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CE}"


PARIS = ("get_weather", {"city": "Paris", "days": 3})
TIME = ("get_time", {})
NESTED = {"city": "東京", "note": "café ☕ \"q\" \\ <｜tool▁call▁end｜? no", "hours": [1, 2]}

CASES = [
    # deepseek_v3: V3 / R1 template, calls joined by "\n"
    ("deepseek_v3", "Let me check.\n\n" + DS_B + v3_call("get_weather", '{"city": "Paris", '
     '"days": 3}') + "\n" + v3_call("get_time", "{}") + DS_E, "Let me check.", [PARIS, TIME]),
    ("deepseek_v3", DS_B + v3_call("get_weather", json.dumps(NESTED, ensure_ascii=False)) + DS_E,
     None, [("get_weather", NESTED)]),
    ("deepseek_v3", "Code:\n```json\n{\"a\": 1}\n```\n", "Code:\n```json\n{\"a\": 1}\n```\n", []),
    ("deepseek_v3", DS_B + f"{DS_CB}function{DS_SEP}get_weather\n```json\nnot json\n```{DS_CE}"
     + DS_E, "functionget_weather\n```json\nnot json\n```", []),  # content, markers out
    # deepseek_v31: V3.1 template
    ("deepseek_v31", "Sure." + DS_B + f"{DS_CB}get_weather{DS_SEP}" + '{"city": "Paris", "days": 3}'
     + DS_CE + f"{DS_CB}get_time{DS_SEP}" + "{}" + DS_CE + DS_E, "Sure.", [PARIS, TIME]),
    ("deepseek_v31", DS_B + f"{DS_CB}get_weather{DS_SEP}"
     + json.dumps(NESTED, ensure_ascii=False) + DS_CE + DS_E + "\n\nDone.", "Done.",
     [("get_weather", NESTED)]),
    ("deepseek_v31", "No tools, a <｜tool bar.", "No tools, a <｜tool bar.", []),
    ("deepseek_v31", DS_B + DS_CB + "get_weather" + DS_SEP + '{"note": "a ' + DS_CE + ' b"}'
     + DS_CE + DS_E, None, [("get_weather", {"note": "a " + DS_CE + " b"})]),  # in a string
    # kimi_k2: the template's ids are functions.NAME:INDEX
    ("kimi_k2", "I'll look." + K_B + K_CB + "functions.get_weather:0" + K_AB
     + '{"city": "Paris", "days": 3}' + K_CE + K_CB + "functions.get_time:1" + K_AB + "{}" + K_CE
     + K_E, "I'll look.", [PARIS, TIME]),
    ("kimi_k2", "<|tool_call_section_begin|>" + K_CB + "functions.get_weather:3" + K_AB
     + json.dumps(NESTED) + K_CE + "<|tool_call_section_end|>", None, [("get_weather", NESTED)]),
    # glm45: GLM-4.5 template; GLM-4.7 without the newlines; typed by the tool's schema
    ("glm45", "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n"
     "<tool_call>get_time\n</tool_call>", "Checking.", [PARIS, TIME]),
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value><arg_key>"
     "hours</arg_key><arg_value>[1, 2]</arg_value><arg_key>note</arg_key><arg_value>null"
     "</arg_value></tool_call>", None,
     [("get_weather", {"city": "42", "hours": [1, 2], "note": None})]),
    ("glm45", "<tool_call>lookup\n<arg_key>n</arg_key>\n<arg_value>42</arg_value>\n<arg_key>q"
     "</arg_key>\n<arg_value>a <b> c</arg_value>\n</tool_call>", None,
     [("lookup", {"n": 42, "q": "a <b> c"})]),  # no schema: JSON when it is JSON
    ("glm45", "<tool_call>bad name\n</tool_call>", "bad name\n", []),
    # granite: Granite 3.x
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 3}}, {"arguments": {}, "name": "get_time"}]', None, [PARIS, TIME]),
    ("granite", ' [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]\nDone.',
     "Done.", [PARIS]),
    ("granite", "[1] is a footnote.", "[1] is a footnote.", []),
    ("granite", ' [ {"a": 1}] is data', ' [ {"a": 1}] is data', []),
    ("granite", '[{"name": "get_weather", "arg', '[{"name": "get_weather", "arg', []),
    ("granite", "<tool_call>not a list", "<tool_call>not a list", []),
    # llama4: pythonic in <|python_start|>, and llama3-style JSON
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Paris", days=3), get_time()]'
     "<|python_end|>", None, [PARIS, TIME]),
    ("llama4_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
     None, [PARIS]),
]
CASE_IDS = [f"{i}-{case[0]}" for i, case in enumerate(CASES)]
CALL_ID = {"kimi_k2": re.compile(r"functions\.\w+:\d+")}
DEFAULT_ID = re.compile(r"call_[A-Za-z0-9]{24}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def streamed(name: str, pieces: list[str], tools=TOOLS, truncated: bool = False):
    """(content, [(name, arguments)]) of a stream, checking the deltas' shapes."""
    parser = get_tool_parser(name)(tools)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish(truncated)]
    calls: list[list[str]] = []
    for delta in deltas:
        for c in delta.calls:
            if c.index == len(calls):
                assert CALL_ID.get(name, DEFAULT_ID).fullmatch(c.id), c.id
                calls.append([c.function.name, c.function.arguments or ""])
            else:
                assert c.index == len(calls) - 1 and c.id is None
                calls[-1][1] += c.function.arguments or ""
    content = "".join(d.content for d in deltas)
    for delimiter in get_tool_parser(name).delimiters:
        assert delimiter not in content
    return content, [(n, a) for n, a in calls]


def decoded(result):
    content, calls = result
    return content, [(n, json.loads(a)) for n, a in calls]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_one_shot(case):
    name, text, content, calls = case
    parsed = get_tool_parser(name)(TOOLS).parse(text)
    assert parsed.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == calls


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_split_gives_the_same_result(case, tokenizer):
    name, text, content, calls = case
    want = (content or "", calls)
    assert decoded(streamed(name, token_pieces(tokenizer, text))) == want
    assert decoded(streamed(name, list(text))) == want  # every marker cut at every character
    for pieces in splits(text):
        assert decoded(streamed(name, pieces)) == want, pieces


def test_kimi_call_ids_are_the_ones_the_model_wrote():
    text = K_B + K_CB + "functions.get_time:7" + K_AB + "{}" + K_CE + K_CB + "get_time" + K_AB \
        + "{}" + K_CE + K_E
    calls = get_tool_parser("kimi_k2")([]).parse(text).calls
    assert calls[0].id == "functions.get_time:7" and DEFAULT_ID.fullmatch(calls[1].id)


@pytest.mark.parametrize("name, head", [
    ("deepseek_v31", DS_B + DS_CB + "get_weather" + DS_SEP),
    ("deepseek_v3", DS_B + DS_CB + "function" + DS_SEP + "get_weather\n```json\n"),
    ("kimi_k2", K_B + K_CB + "functions.get_weather:0" + K_AB),
])
def test_arguments_stream_as_they_are_written(name, head):
    parser = get_tool_parser(name)([])
    assert parser.feed("Hi " + head[:5]).content == "Hi"  # a marker may be starting
    first = parser.feed(head[5:] + '{"city": "Pa')
    assert [c.function.name for c in first.calls if c.id] == ["get_weather"]
    assert "".join(c.function.arguments or "" for c in first.calls) == '{"city": "Pa'
    end = DS_CE if name.startswith("deepseek") else K_CE
    rest = parser.feed('ris"}' + ("\n```" if name == "deepseek_v3" else "") + end[:4])
    assert [c.function.arguments for c in rest.calls] == ['ris"}'] and rest.content == ""


@pytest.mark.parametrize("name, text, calls", [
    ("deepseek_v31", "Ok." + DS_B + DS_CB + "get_weather" + DS_SEP + '{"city": "Pa"}', 1),
    ("deepseek_v3", "Ok." + DS_B + DS_CB + "function" + DS_SEP + "get_wea", 0),
    ("kimi_k2", "Ok." + K_B + K_CB + "functions.get_weather:0" + K_AB + "[", 0),
    ("kimi_k2", "Ok." + K_B[:9], 0),
    ("glm45", "Ok.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", 0),
    ("granite", '[{"name": "get_weather", "arguments": {"city": "Pa', 0),
])
def test_markup_cut_by_max_tokens_is_not_content(name, text, calls):
    content, got = streamed(name, list(text), truncated=True)
    assert content == ("" if name == "granite" else "Ok.") and len(got) == calls


FRAGMENTS = [DS_B, DS_E, DS_CB, DS_CE, DS_SEP, "<｜tool", K_B, K_E, K_CB, K_AB, K_CE, "<|tool",
             "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
             "</arg_value>", "<|tool_call|>", "[", "]", "{", "}", '"', ",", " ", "\n", "```json",
             "function", "get_weather", "functions.f:0", '{"a": 1}', "é😀", "x"]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "granite"])
def test_random_text_is_split_invariant(name):
    rng = random.Random(name)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        want = streamed(name, [text], tools=[])
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(name, pieces, tools=[]) == want, (text, pieces)


# -- reasoning -------------------------------------------------------------------------------

DS31_THINK = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>"
DS31_NO_THINK = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
GLM = "[gMASK]<sop><|user|>\nhi<|assistant|>"
KIMI = "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
GRANITE = ("<|start_of_role|>system<|end_of_role|>Write your thoughts after 'Here is my "
           "thought process:' and write your response after 'Here is my response:' for each "
           "user query.<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>")

REASONING = [
    ("deepseek_v3", DS31_THINK, "Paris, surely.\n</think>\n\nParis.", "Paris, surely.", "Paris."),
    ("deepseek_v3", DS31_NO_THINK, "Paris.", None, "Paris."),
    ("deepseek_v3", "<｜User｜>hi<｜Assistant｜>", "Paris.", None, "Paris."),
    ("glm45", GLM, "<think>The capital.</think>\nParis.", "The capital.", "Paris."),
    ("glm45", GLM + "\n<think></think>\n", "Paris.", None, "Paris."),
    ("glm45", GLM, "Paris.", None, "Paris."),
    ("kimi_k2", KIMI, "The capital.</think>Paris.", "The capital.", "Paris."),
    ("kimi_k2", KIMI, "<think>Call it.\n" + K_B + K_CB, "Call it.", K_B + K_CB),
    ("granite", GRANITE, "Here is my thought process:\nThe capital.\n\nHere is my response:\n"
     "Paris.", "The capital.", "Paris."),
    ("granite", GRANITE, "Here's my thought process:\nHm.\nHere's my response:\nParis.", "Hm.",
     "Paris."),
    ("granite", GRANITE, "Paris. Here is my answer.", None, "Paris. Here is my answer."),
]


@pytest.mark.parametrize("case", REASONING, ids=[f"{i}-{c[0]}" for i, c in enumerate(REASONING)])
def test_reasoning_in_every_split(case):
    name, prompt, text, reasoning, content = case
    assert get_reasoning_parser(name)(prompt).parse(text) == (reasoning, content)
    for pieces in [list(text), *([text[:i], text[i:]] for i in range(len(text) + 1))]:
        parser = get_reasoning_parser(name)(prompt)
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        got = ("".join(d.reasoning for d in deltas) or None,
               "".join(d.content for d in deltas) or None)
        assert got == (reasoning, content), pieces


def test_kimi_thinking_then_a_call_reaches_the_tool_parser():
    """Kimi may open its tool section without closing the thinking: the section ends the
    reasoning and is the tool parser's."""
    text = "Need the weather.\n" + K_B + K_CB + "functions.get_weather:0" + K_AB \
        + '{"city": "Oslo"}' + K_CE + K_E
    thought, content = get_reasoning_parser("kimi_k2")(KIMI).parse(text)
    calls = get_tool_parser("kimi_k2")(TOOLS).parse(content).calls
    assert thought == "Need the weather." and [c.function.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("case", [c for c in CASES if len(c[3]) == 2 and c[0] != "llama4_pythonic"],
                         ids=lambda c: c[0])
def test_each_call_goes_out_before_the_output_ends(case):
    """Streamed, not one-shot at the end: each call is out once its own text is, before the
    next one is written and before finish(). (pythonic's list is read whole.)"""
    name, text, _, calls = case
    parser = get_tool_parser(name)(TOOLS)
    out_at = []
    for i, ch in enumerate(text):
        out_at += [i] * sum(1 for c in parser.feed(ch).calls if c.id is not None)
    assert len(out_at) == len(calls) and out_at[0] < out_at[1] - 10, out_at
