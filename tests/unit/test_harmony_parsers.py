"""gpt-oss's Harmony format, parsed (postproc.harmony, `openai_gptoss` + `openai`): channels go
to reasoning, content and tool calls; streaming gives the one-shot result for every split of
the text (a hypothesis property over token-like pieces); and the result agrees with
openai-harmony's own parser on conversations it renders (its o200k vocabulary unzipped from
the bpe-openai wheel: nothing is downloaded)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from postproc.reasoning import get_reasoning_parser
from postproc.tool_parsers import collect, get_tool_parser
from tests.harmony_reference import harmony_encoding

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
         {"type": "function", "function": {"name": "lookup", "parameters": {}}}]

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"


def call(name: str, args: str, *, recipient_first: bool = False) -> str:
    if recipient_first:
        return (f"<|start|>assistant to=functions.{name}<|channel|>commentary json"
                f"<|message|>{args}")
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
            f"<|message|>{args}")


# (output text as the detokenizer gives it: <|return|> / <|call|> are the stop token and cut,
#  reasoning, content, [(name, arguments)])
CASES = [
    (ANALYSIS + "Think.<|end|>" + FINAL + "Paris.", "Think.", "Paris.", []),
    ("<|channel|>final<|message|>Just the answer", None, "Just the answer", []),
    (ANALYSIS + "Need the weather.<|end|>" + call("get_weather", '{"city": "Paris"}'),
     "Need the weather.", None, [("get_weather", '{"city": "Paris"}')]),
    (ANALYSIS + "x<|end|><|start|>assistant<|channel|>commentary<|message|>Checking now."
     "<|end|>" + call("lookup", '{"q": 1}'), "x", "Checking now.", [("lookup", '{"q": 1}')]),
    # Recipient before the channel, as Harmony also allows.
    (" to=functions.get_weather<|channel|>commentary json<|message|>{\"a\": [1, 2]}", None,
     None, [("get_weather", '{"a": [1, 2]}')]),
    (ANALYSIS + "a<|end|>" + call("lookup", "{}", recipient_first=True), "a", None,
     [("lookup", "{}")]),
    # Two analysis messages, then the answer.
    (ANALYSIS + "one <|end|><|start|>assistant" + ANALYSIS + "two<|end|>" + FINAL + "ok",
     "one two", "ok", []),
    # A built-in tool (python) is the model's own business: reasoning.
    ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", "print(1)", None, []),
    # No header at all: a model that ignores the format; its text is content.
    ("plain text <b>", None, "plain text <b>", []),
    # Cut short inside a header (max_tokens): nothing of it shows.
    (ANALYSIS + "hm<|end|><|start|>assistant<|channel|>fin", "hm", None, []),
    # Text in the final channel that looks a little like a marker.
    ("<|channel|>final<|message|>a <| b |> c", None, "a <| b |> c", []),
]
IDS = [str(i) for i in range(len(CASES))]


def both(text: str, pieces: list[str] | None = None):
    """(reasoning, content, calls) through openai_gptoss then openai, fed `pieces`."""
    reasoning = get_reasoning_parser("openai_gptoss")("")
    tools = get_tool_parser("openai")(TOOLS, call_id_seed="req")
    got_reasoning, deltas = [], []
    for piece in (pieces if pieces is not None else [text]):
        d = reasoning.feed(piece)
        got_reasoning.append(d.reasoning)
        deltas.append(tools.feed(d.content))
    d = reasoning.finish()
    got_reasoning.append(d.reasoning)
    deltas += [tools.feed(d.content), tools.finish()]
    parsed = collect(deltas)
    return ("".join(got_reasoning) or None, parsed.content,
            [(c.function.name, c.function.arguments) for c in parsed.calls], deltas)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_shot(case):
    text, reasoning, content, calls = case
    got_reasoning, got_content = get_reasoning_parser("openai_gptoss")("").parse(text)
    assert got_reasoning == reasoning
    parsed = get_tool_parser("openai")(TOOLS).parse(got_content or "")
    assert parsed.content == content
    assert [(c.function.name, c.function.arguments) for c in parsed.calls] == calls
    for value in (got_reasoning or "", parsed.content or ""):
        assert "<|channel|>" not in value and "<|message|>" not in value


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_split(case):
    text, reasoning, content, calls = case
    for i in range(len(text) + 1):
        for width in (1, 3, 7):
            pieces = [text[:i], text[i:i + width], text[i + width:]]
            assert both(text, pieces)[:3] == (reasoning, content, calls), pieces
    assert both(text, list(text))[:3] == (reasoning, content, calls)


def test_arguments_stream_before_the_call_ends():
    """The call's header goes out once its header is complete; arguments follow in pieces."""
    text = ANALYSIS + "r<|end|>" + call("get_weather", '{"city": "Paris"}')
    cut = text.index('"Paris"')
    *_, deltas = both(text, [text[:cut], text[cut:]])
    first = [c for c in deltas[0].calls]
    assert first[0].function.name == "get_weather" and first[0].id
    assert "".join(c.function.arguments or "" for c in first) == '{"city": '


def test_tool_parser_alone_reads_raw_harmony():
    """Without the reasoning parser the analysis text is content (nothing is lost)."""
    text = ANALYSIS + "Think.<|end|>" + call("lookup", '{"q": 2}')
    parsed = get_tool_parser("openai")(TOOLS).parse(text)
    assert parsed.content == "Think."
    assert [(c.function.name, c.function.arguments) for c in parsed.calls] == [
        ("lookup", '{"q": 2}')]


def test_named_tool_choice_prefill():
    """A named tool_choice injects the begin marker; the output continues the header."""
    parser = get_tool_parser("openai")(TOOLS, prefill="<|channel|>commentary to=functions.")
    parsed = parser.parse('lookup <|constrain|>json<|message|>{"q": 3}')
    assert [(c.function.name, c.function.arguments) for c in parsed.calls] == [
        ("lookup", '{"q": 3}')]
    assert parsed.content is None


PIECES = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>",
          "<|return|>", "<|", "|>", "<", "assistant", "analysis", "final", "commentary",
          " to=functions.lookup", " to=python", " json", "{\"q\": 1}", "text", " ", "\n", "é😀"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.data())
def test_stream_equals_one_shot_for_any_split(tokens, data):
    """Any sequence of token-like pieces, streamed in any grouping, parses as the whole."""
    text = "".join(tokens)
    want = both(text)[:3]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=5)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    got = both(text, pieces)
    assert got[:3] == want
    for value in (got[0] or "", got[1] or ""):
        for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>"):
            assert marker not in value


# -- openai-harmony as the reference ------------------------------------------------------

@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    return harmony_encoding(tmp_path_factory.getbasetemp() / "tiktoken")  # unzipped once


def test_agrees_with_openai_harmony(harmony):
    """Messages rendered by openai-harmony, decoded to text as our detokenizer does (markers
    kept), parse to what openai-harmony's own parser reads from the same tokens."""
    oh, enc = harmony
    msg = oh.Message.from_role_and_content
    turns = [
        [msg(oh.Role.ASSISTANT, "Thinking about é😀.").with_channel("analysis"),
         msg(oh.Role.ASSISTANT, "The answer.").with_channel("final")],
        [msg(oh.Role.ASSISTANT, "I should call.").with_channel("analysis"),
         msg(oh.Role.ASSISTANT, "One moment.").with_channel("commentary"),
         msg(oh.Role.ASSISTANT, '{"city": "Oslo"}').with_channel("commentary")
         .with_recipient("functions.get_weather").with_content_type("<|constrain|>json")],
    ]
    for messages in turns:
        tokens = []
        for m in messages:
            tokens += enc.render(m)
        # The prompt ends with `<|start|>assistant`: the output starts after it.
        assert enc.decode_utf8(tokens[:2]) == "<|start|>assistant"
        tokens = tokens[2:-1]  # and the stop token (<|return|> / <|call|>) is not text
        reference = enc.parse_messages_from_completion_tokens(tokens, oh.Role.ASSISTANT)
        want_reasoning = "".join(m.content[0].text for m in reference
                                 if m.channel == "analysis") or None
        want_content = "".join(m.content[0].text for m in reference
                               if m.channel != "analysis" and not m.recipient) or None
        want_calls = [(m.recipient.removeprefix("functions."), m.content[0].text)
                      for m in reference if m.recipient]
        text = enc.decode_utf8(tokens)
        reasoning, content, calls, _ = both(text)
        assert (reasoning, content, calls) == (want_reasoning, want_content, want_calls)
        # Token by token, as the engine streams it.
        pieces, done = [], ""
        for k in range(1, len(tokens) + 1):
            try:  # a token that ends inside a character waits for the next, as ours do
                prefix = enc.decode_utf8(tokens[:k])
            except Exception:  # noqa: BLE001 - openai-harmony's error type for bad UTF-8
                continue
            pieces.append(prefix[len(done):])
            done = prefix
        assert both(text, pieces)[:3] == (want_reasoning, want_content, want_calls)
        assert json.dumps(calls)  # plain data
