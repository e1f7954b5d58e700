"""Forced calls (req C-1 to C-3) in issue 52's formats, and the command line that names the
parsers. llguidance matchers on the real SmolLM2 tokenizer: a call the format's template
would write is accepted and read back into that call, a wrong name or type is refused; a
named tool_choice injects the parser's begin marker; a vocabulary holding the markers as
special tokens gets them named by id."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import llguidance.hf
import pytest
from llguidance import LLMatcher

import tests.unit.test_forced_call_grammars as forced
from postproc.reasoning import get_reasoning_parser
from postproc.tool_parsers import collect, get_tool_parser
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer
from sluice import cli
from tests.unit.test_family_parsers import (
    DS_B,
    DS_CB,
    DS_CE,
    DS_E,
    DS_SEP,
    K_AB,
    K_B,
    K_CB,
    K_CE,
    K_E,
)
from tests.unit.test_forced_call_grammars import (
    ARGS,
    NAMED,
    TIME,
    WEATHER,
    WEATHER_SCHEMA,
    accepts,
    chat,
    constraint,
    llt,  # noqa: F401  (the fixture)
    parsed,
    sample,
    settings,
    spell,
)

PARSERS = ("deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "granite", "llama4_pythonic",
           "llama4_json")
TOOL_NAMES = ("deepseek_v3", "deepseek_v31", "glm45", "granite", "kimi_k2", "llama4_json",
              "llama4_pythonic")
REASONING_NAMES = ("deepseek_v3", "glm45", "granite", "kimi_k2")


def family_call(parser: str, name: str, args: dict, index: int = 0) -> str:
    """One call as the family's chat template writes it, without the section markers."""
    text = json.dumps(args)
    if parser == "deepseek_v3":
        return f"{DS_CB}function{DS_SEP}{name}\n```json\n{text}\n```{DS_CE}"
    if parser == "deepseek_v31":
        return f"{DS_CB}{name}{DS_SEP}{text}{DS_CE}"
    if parser == "kimi_k2":
        return f"{K_CB}functions.{name}:{index}{K_AB}{text}{K_CE}"
    if parser == "glm45":
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>"
                        f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                        for k, v in args.items())
        return f"<tool_call>{name}\n{pairs}</tool_call>"
    if parser == "granite":
        return json.dumps({"name": name, "arguments": args})
    if parser == "llama4_json":
        return "<|python_tag|>" + json.dumps({"name": name, "parameters": args})
    return spell("pythonic", name, args)


def family_calls(parser: str, calls: list[tuple[str, dict]]) -> str:
    each = [family_call(parser, n, a, i) for i, (n, a) in enumerate(calls)]
    if parser.startswith("deepseek"):
        gap = "\n" if parser == "deepseek_v3" else ""
        return DS_B + gap.join(each) + DS_E
    if parser == "kimi_k2":
        return K_B + "".join(each) + K_E
    if parser == "granite":
        return "<|tool_call|>[" + ", ".join(each) + "]"
    if parser == "llama4_json":
        return each[0] + "".join("; " + c[len("<|python_tag|>"):] for c in each[1:])
    if parser == "llama4_pythonic":
        return "[" + ", ".join(c[1:-1] for c in each) + "]"
    return "\n".join(each)


@pytest.mark.parametrize("parser", PARSERS)
def test_required_accepts_template_calls_and_reads_them_back(llt, parser):  # noqa: F811
    c = constraint(chat(tools=[WEATHER, TIME], tool_choice="required"), settings(llt, parser))
    one = [("get_weather", ARGS)]
    two = [("get_weather", ARGS), ("get_time", {"x": "a"})]
    for calls in (one, two):
        text = family_calls(parser, calls)
        assert accepts(llt, c.grammar, text), text
        assert parsed(parser, text) == (None, calls)
    good = family_calls(parser, one)
    assert not accepts(llt, c.grammar, "Sure! " + good)
    assert not accepts(llt, c.grammar, family_calls(parser, [("get_wether", {"city": "X"})]))
    assert not accepts(llt, c.grammar, family_calls(parser, [("get_weather", {"city": "X",
                                                                              "days": 30})]))
    assert not accepts(llt, c.grammar, family_calls(parser, [("get_weather", {"days": 3})]))


@pytest.mark.parametrize("parser", ["deepseek_v3", "glm45"])
def test_sampled_outputs_parse_into_schema_valid_calls(llt, parser, monkeypatch):  # noqa: F811
    """Random walks of the token masks: whatever the grammar lets through is calls whose
    arguments validate, read the same streamed one character at a time."""
    monkeypatch.setattr(forced, "CLOSERS", (*forced.CLOSERS, "</arg_value>\n", "</tool_call>",
                                            "\n```", DS_CE, DS_E))
    c = constraint(chat(tools=[WEATHER, TIME], tool_choice="required"), settings(llt, parser))
    rng = random.Random(52)
    schemas = {"get_weather": WEATHER_SCHEMA, "get_time": {"type": "object"}}
    done = 0
    for _ in range(6):
        text = sample(llt, c.grammar, rng, max_tokens=400)  # the markers are many tokens here
        if text is None:
            continue
        done += 1
        result = get_tool_parser(parser)([WEATHER, TIME]).parse(text)
        assert result.content is None and result.calls, text
        for call in result.calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        streamed = get_tool_parser(parser)([WEATHER, TIME])
        pieces = [streamed.feed(ch) for ch in text] + [streamed.finish()]
        assert [(c.function.name, json.loads(c.function.arguments))
                for c in collect(pieces).calls] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in result.calls]
    assert done >= 3


@pytest.mark.parametrize("parser", PARSERS)
def test_named_tool_choice_injects_the_begin_marker(llt, parser):  # noqa: F811
    from frontend.input.structured import forced_call_prefix
    structured = settings(llt, parser)
    request = chat(tools=[WEATHER, TIME], tool_choice=NAMED)
    prefix = forced_call_prefix(request, structured)
    assert prefix == get_tool_parser(parser).begin_marker
    full = family_calls(parser, [("get_weather", {"city": "Rome", "days": 2})])
    assert full.startswith(prefix)
    c = constraint(request, structured)
    assert accepts(llt, c.grammar, full[len(prefix):])
    assert not accepts(llt, c.grammar, family_calls(parser, [("get_time", {})])[len(prefix):])
    assert parsed(parser, full[len(prefix):], prefill=prefix) == (
        None, [("get_weather", {"city": "Rome", "days": 2})])


@pytest.mark.parametrize("parser", PARSERS)
def test_strict_tools_constrain_calls_and_leave_text_free(llt, parser):  # noqa: F811
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    c = constraint(chat(tools=[strict, TIME]), settings(llt, parser))
    assert accepts(llt, c.grammar, "Just text, no call.")
    assert accepts(llt, c.grammar, family_calls(parser, [("get_weather", {"city": "X"})]))
    assert not accepts(llt, c.grammar, family_calls(parser, [("get_weather", {"city": "X",
                                                                              "days": 0})]))


SPECIAL = {"deepseek_v31": [DS_B, DS_CB, DS_SEP, DS_CE, DS_E],
           "kimi_k2": [K_B, K_CB, K_AB, K_CE, K_E], "granite": ["<|tool_call|>"]}


@pytest.fixture(scope="module")
def special_vocab():
    """The SmolLM2 tokenizer with the families' markers as special tokens, as in theirs."""
    hf = copy.deepcopy(load_tokenizer(default_model_path()))
    hf.add_special_tokens({"additional_special_tokens": [t for ts in SPECIAL.values()
                                                         for t in ts]})
    return hf, llguidance.hf.from_tokenizer(hf, eos_token=[2])


@pytest.mark.parametrize("parser", sorted(SPECIAL))
def test_special_token_markers_are_named_by_id(parser, special_vocab):
    hf, vocab = special_vocab
    tokens = SPECIAL[parser]
    spelled = get_tool_parser(parser).for_vocabulary(vocab)
    assert spelled.name == parser and f"<[{hf.convert_tokens_to_ids(tokens[0])}]>" in \
        spelled.begin_lark
    assert get_tool_parser(parser).for_vocabulary(None) is get_tool_parser(parser)
    c = constraint(chat(tools=[WEATHER], tool_choice="required"), settings(vocab, parser))
    text = family_calls(parser, [("get_weather", {"city": "Oslo"})])
    ids = vocab.tokenize_str(text)
    assert ids[0] == hf.convert_tokens_to_ids(tokens[0])
    matcher = LLMatcher(vocab, c.grammar, log_level=0)
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    # Strict tools: text, then calls opened by the special token, then text again (granite's
    # calls open the output or not at all).
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    c = constraint(chat(tools=[strict]), settings(vocab, parser))
    matcher = LLMatcher(vocab, c.grammar, log_level=0)
    before = "" if parser == "granite" else "Checking. "
    assert matcher.consume_tokens(vocab.tokenize_str(before) + ids
                                  + vocab.tokenize_str(" Done."))
    wrong = vocab.tokenize_str(family_calls(parser, [("get_weather", {"city": 3})]))
    assert not LLMatcher(vocab, c.grammar, log_level=0).consume_tokens(wrong)


@pytest.mark.parametrize("parser", sorted(SPECIAL))
def test_the_postproc_step_keeps_the_markers_for_the_parser(parser, special_vocab):
    """A request that skips special tokens still gives the parser its markers: they are
    its delimiters (postproc.processor.special_ids_to_skip)."""
    from postproc.processor import special_ids_to_skip
    hf, _ = special_vocab
    skipped = special_ids_to_skip(hf, None, parser)
    assert not skipped & set(hf.convert_tokens_to_ids(SPECIAL[parser]))
    assert hf.convert_tokens_to_ids("<|im_end|>") in skipped


def test_granite_thinking_before_a_forced_call(llt):  # noqa: F811
    """Granite's thinking opens with a sentence, not a tag: the grammar's section is the one
    the parser reads, and a call follows it."""
    from frontend.input.structured import StructuredSettings, build_constraint
    from frontend.pipeline.sampling import check_request
    structured = StructuredSettings(tool_call_parser="granite", reasoning_parser="granite",
                                    tokenizer=llt)
    request = chat(tools=[WEATHER], tool_choice="required")
    check_request(request, structured)
    grammar = build_constraint(request, structured, in_reasoning=False).grammar
    call = family_calls("granite", [("get_weather", {"city": "Oslo"})])
    text = "Here is my thought process:\nRain?\nHere is my response:\n" + call
    assert accepts(llt, grammar, call) and accepts(llt, grammar, text)
    thought, content = get_reasoning_parser("granite").starting(False).parse(text)
    assert thought == "Rain?" and parsed("granite", content)[1] == [("get_weather",
                                                                       {"city": "Oslo"})]
    assert not accepts(llt, grammar, "Here is my response:\n" + call)


@pytest.mark.parametrize("reasoning, tools, thought, stop", [
    ("kimi_k2", "kimi_k2", "<think>Rain?</think>", K_B),
    ("granite", "granite", "Here is my thought process:\nRain?\nHere is my response:\n",
     "Here's my response:"),
])
def test_thinking_cannot_hold_what_ends_it_for_the_parser(llt, reasoning, tools, thought,  # noqa: F811
                                                          stop):
    """Kimi's thinking also ends at a tool-call section, Granite's at "Here's my response:":
    the grammar's thinking holds neither, so what it allows reads back as thinking, then a
    call."""
    from frontend.input.structured import StructuredSettings, build_constraint
    from frontend.pipeline.sampling import check_request
    structured = StructuredSettings(tool_call_parser=tools, reasoning_parser=reasoning,
                                    tokenizer=llt)
    request = chat(tools=[WEATHER], tool_choice="required")
    check_request(request, structured)
    call = family_calls(tools, [("get_weather", {"city": "Oslo"})])
    for inside in (False, True):
        grammar = build_constraint(request, structured, in_reasoning=inside).grammar
        opened = thought if not inside else thought.split("Rain?")[1]
        body = "Rain?" + opened if inside else thought
        assert accepts(llt, grammar, body + call), body
        spoiled = body.replace("Rain?", "Rain? " + stop + " no")
        assert not accepts(llt, grammar, spoiled + call), spoiled
        text = body + call
        got, content = get_reasoning_parser(reasoning).starting(inside).parse(text)
        assert got == "Rain?" and parsed(tools, content)[1] == [("get_weather",
                                                                   {"city": "Oslo"})]


def _serve_options(argv: list[str]):
    return cli.parse_args(["serve", "some/model", *argv])


@pytest.mark.parametrize("name", TOOL_NAMES)
def test_the_command_line_takes_the_tool_parsers(name):
    assert _serve_options(["--tool-call-parser", name]).tool_call_parser == name


@pytest.mark.parametrize("name", REASONING_NAMES)
def test_the_command_line_takes_the_reasoning_parsers(name):
    assert _serve_options(["--reasoning-parser", name]).reasoning_parser == name


def test_the_command_line_refuses_an_unknown_parser(capsys):
    with pytest.raises(SystemExit):
        _serve_options(["--tool-call-parser", "deepseek_v4"])
    assert "deepseek_v31" in capsys.readouterr().err  # the choices are named
