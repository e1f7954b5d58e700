"""Reasoning parsers (req O-2, O-5): the thinking state comes from the rendered prompt, tags
never leak (not even half of one), and streaming gives the one-shot result however the text is
split: one real token at a time (SmolLM2 tokenizer), one character at a time, and cut into two
or three pieces at every boundary."""

from __future__ import annotations

import random

import pytest

from postproc.reasoning import (
    REASONING_PARSERS,
    ReasoningDelta,
    get_reasoning_parser,
    prompt_think_state,
)
from shared.model_source import default_model_path
from shared.tokenizer import load_tokenizer
from tests.unit.parser_builders import token_pieces

# Rendered prompts, as the templates write them.
R1_OPEN = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
R1_PLAIN = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"
R1_CLOSED = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜></think>"
Q_PLAIN = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
Q_OPEN = Q_PLAIN + "<think>\n"
Q_NO_THINK = Q_PLAIN + "<think>\n\n</think>\n\n"  # enable_thinking=False
Q_HISTORY = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nGreeting.\n</think>\n\n"
    "Hello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)
Q_USER_TAG = "<|im_start|>user\nWhat does <think> mean?<|im_end|>\n<|im_start|>assistant\n"

# (parser, prompt, output, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", R1_OPEN, "Let me add.\n2+2=4.\n</think>\n\nThe answer is **4**.",
     "Let me add.\n2+2=4.", "The answer is **4**."),
    ("deepseek_r1", R1_PLAIN, "<think>\nThinking about it...\n</think>\n\n4",
     "Thinking about it...", "4"),
    ("deepseek_r1", R1_PLAIN, "No tag at all, still thinking.\n</think>\nDone.",
     "No tag at all, still thinking.", "Done."),
    ("deepseek_r1", R1_OPEN, "I am still thinking about </thi", "I am still thinking about </thi",
     None),
    ("deepseek_r1", R1_CLOSED, "The answer is 4.", None, "The answer is 4."),
    ("deepseek_r1", R1_CLOSED, "Plain <thinking> text\n", None, "Plain <thinking> text\n"),
    ("deepseek_r1", R1_OPEN, "</think>Straight to the answer.", None, "Straight to the answer."),
    ("qwen3", Q_PLAIN, "<think>\nHmm, 2+2.\n</think>\n\nIt is 4.", "Hmm, 2+2.", "It is 4."),
    ("qwen3", Q_PLAIN, "Just an answer, no thinking: a < b, <th", None,
     "Just an answer, no thinking: a < b, <th"),
    ("qwen3", Q_OPEN, "The prompt opened it.\n</think>\n\nAnswer: 4", "The prompt opened it.",
     "Answer: 4"),
    ("qwen3", Q_NO_THINK, "  4, and a stray </think> tag.", None, "  4, and a stray  tag."),
    ("qwen3", Q_HISTORY, "<think>\nNew turn.\n</think>\n\n4", "New turn.", "4"),
    ("qwen3", Q_HISTORY, "Four.", None, "Four."),
    ("qwen3", Q_USER_TAG, "It marks reasoning.", None, "It marks reasoning."),
    ("qwen3", Q_PLAIN, "<think>\n日本語で考える 🤔 — ü\n</think>\n\n答え: 4 ✅",
     "日本語で考える 🤔 — ü", "答え: 4 ✅"),
    ("qwen3", Q_PLAIN, "<think>a<think>b</think>c<think>d</think>e", "abd", "ce"),
    ("qwen3", Q_PLAIN, "<think>\nunfinished thought", "unfinished thought", None),
    ("qwen3", Q_PLAIN, "", None, None),
]
CASE_IDS = [f"{i}-{case[0]}" for i, case in enumerate(CASES)]
TAGS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def stream(name: str, prompt: str, pieces: list[str]) -> list[ReasoningDelta]:
    parser = get_reasoning_parser(name)(prompt)
    return [parser.feed(p) for p in pieces] + [parser.finish()]


def check_stream(name, prompt, pieces, reasoning, content):
    deltas = stream(name, prompt, pieces)
    got_reasoning = "".join(d.reasoning for d in deltas)
    got_content = "".join(d.content for d in deltas)
    assert (got_reasoning, got_content) == (reasoning or "", content or ""), pieces
    for tag in TAGS:
        assert tag not in got_reasoning and tag not in got_content


def splits(text: str):
    n = len(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
        for width in (1, 2, 3, 5, 8):
            if i + width <= n:
                yield [text[:i], text[i:i + width], text[i + width:]]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_one_shot(case):
    name, prompt, text, reasoning, content = case
    assert get_reasoning_parser(name)(prompt).parse(text) == (reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_streaming_token_by_token(case, tokenizer):
    name, prompt, text, reasoning, content = case
    check_stream(name, prompt, token_pieces(tokenizer, text), reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_streaming_every_split(case):
    name, prompt, text, reasoning, content = case
    check_stream(name, prompt, list(text), reasoning, content)
    for pieces in splits(text):
        check_stream(name, prompt, pieces, reasoning, content)


def test_tags_split_across_tokens_are_held(tokenizer):
    """SmolLM2 spells `</think>` as several tokens: no piece of it is streamed."""
    parser = get_reasoning_parser("qwen3")(Q_PLAIN)
    text = "<think>\nabc\n</think>\n\nxyz"
    pieces = token_pieces(tokenizer, text)
    assert "</think>" not in pieces  # the tag really is split
    seen = []
    for piece in pieces:
        d = parser.feed(piece)
        seen.append(d.reasoning + d.content)
        assert "<" not in d.reasoning + d.content
    assert parser.in_reasoning is False
    d = parser.finish()
    assert "".join(seen) + d.reasoning + d.content == "abcxyz"


def test_in_reasoning_follows_the_output():
    parser = get_reasoning_parser("deepseek_r1")(R1_PLAIN)
    assert parser.in_reasoning
    parser.feed("thinking</th")
    assert parser.in_reasoning
    assert parser.feed("ink>answer") == ReasoningDelta("", "answer")
    assert not parser.in_reasoning
    assert not get_reasoning_parser("qwen3")(Q_NO_THINK).in_reasoning
    assert get_reasoning_parser("qwen3")(Q_OPEN).in_reasoning


def test_reasoning_whitespace_is_held_not_lost():
    parser = get_reasoning_parser("qwen3")(Q_OPEN)
    assert parser.feed("one\n\n").reasoning == "one"
    assert parser.feed("two").reasoning == "\n\ntwo"


def test_parse_leaves_the_streaming_state_alone():
    parser = get_reasoning_parser("qwen3")(Q_OPEN)
    parser.feed("part of the reasoning </thi")
    assert parser.parse("x</think>y") == ("x", "y")  # fresh state, same prompt
    assert parser.feed("nk>answer") == ReasoningDelta("", "answer")


@pytest.mark.parametrize(
    ("prompt", "state"),
    [
        (R1_OPEN, "open"),
        (R1_PLAIN, None),
        (R1_CLOSED, "closed"),
        (Q_PLAIN, None),
        (Q_OPEN, "open"),
        (Q_NO_THINK, "closed"),
        (Q_HISTORY, None),
        (Q_USER_TAG, None),
        (Q_OPEN + "Let me", "open"),  # continue_final_message inside the thinking block
        ("", None),
    ],
)
def test_prompt_think_state(prompt, state):
    assert prompt_think_state(prompt, "<think>", "</think>") == state


def test_registry():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "openai_gptoss", "qwen3", "deepseek_v3",
                                      "glm45", "granite", "kimi_k2"}
    with pytest.raises(ValueError, match="^unknown reasoning parser 'nope'; known: deepseek_r1, "
                                         "deepseek_v3, glm45, granite, kimi_k2, "
                                         "openai_gptoss, qwen3$"):
        get_reasoning_parser("nope")


FRAGMENTS = ["<think>", "</think>", "<th", "ink>", "</", "<", ">", "think", " ", "\n", "a",
             "é😀", "<|im_end|>", "answer"]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", ["", R1_OPEN, Q_NO_THINK])
def test_random_text_is_split_invariant(name, prompt):
    rng = random.Random(name + prompt)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        want = get_reasoning_parser(name)(prompt).parse(text)
        for _ in range(3):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            deltas = stream(name, prompt, pieces)
            got = ("".join(d.reasoning for d in deltas) or None,
                   "".join(d.content for d in deltas) or None)
            assert got == want, (text, pieces)
