"""Usage's reasoning_tokens: the output tokens the reasoning parser read as reasoning, counted
by the postproc step token by token. The markers that open and close a section (`<think>`,
`</think>`, Harmony's headers and `<|end|>`) count in completion_tokens but not as reasoning
(vLLM counts the same way); any split of the tokens into frames gives the same count."""

from __future__ import annotations

import json

import pytest

from postproc.processor import OutputProcessor
from shared.protocol import ChunkFormat, OutputParams, RequestOutput, pack_ids
from shared.tokenizer import load_tokenizer
from tests.harmony_model import harmony_tokenizer


@pytest.fixture(scope="module")
def think_tokenizer():
    """The default tokenizer with `<think>` / `</think>` as special tokens (as in Qwen3 and
    DeepSeek-R1, where each tag is one token)."""
    tok = load_tokenizer("default")
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tok


@pytest.fixture(scope="module")
def harmony_tok():
    return harmony_tokenizer()


def encode(tok, *parts: str) -> list[int]:
    """Each part on its own: special tokens by name, text encoded."""
    ids: list[int] = []
    for part in parts:
        special = tok.convert_tokens_to_ids(part) if part.startswith("<") else None
        if special is not None and special != tok.unk_token_id and part in tok.get_vocab():
            ids.append(special)
        else:
            ids.extend(tok.encode(part, add_special_tokens=False))
    return ids


def run(tok, ids, params: OutputParams, sizes=None, finish=("length", None)):
    """Feeds ids in frames of `sizes` tokens (one per frame by default); returns the frames."""
    processor = OutputProcessor(tok)
    processor.register("r", [1, 2, 3], params)
    sizes = sizes or [1] * len(ids)
    frames, done = [], 0
    for size in sizes:
        chunk = ids[done:done + size]
        done += len(chunk)
        last = done >= len(ids)
        frames.extend(processor.process([RequestOutput(
            request_id="r", new_token_ids=pack_ids(chunk), num_prompt_tokens=3,
            num_output_tokens=done, finish_reason=finish[0] if last else None,
            stop_reason=finish[1] if last else None)]).frames)
        if last:
            break
    return frames


def splits(n: int) -> list[list[int] | None]:
    """One token per frame, all in one frame, and frames of 3."""
    return [None, [n], [3] * (n // 3 + 1)]


THINKING = "\nThe user asks about Paris, so the answer is short.\n"
ANSWER = "\n\nParis."


@pytest.mark.parametrize("sizes_of", range(3))
def test_think_tags_are_not_reasoning_tokens(think_tokenizer, sizes_of):
    tok = think_tokenizer
    body = encode(tok, THINKING)
    ids = encode(tok, "<think>") + body + encode(tok, "</think>", ANSWER)
    frames = run(tok, ids, OutputParams(reasoning_parser="qwen3"), splits(len(ids))[sizes_of])
    assert "".join(f.reasoning for f in frames) == THINKING.strip()
    assert "".join(f.text for f in frames) == ANSWER.lstrip()
    # Every token between the tags (the layout newlines too, as in vLLM), neither tag.
    assert frames[-1].num_reasoning_tokens == len(body)
    assert frames[-1].num_output_tokens == len(body) + 2 + len(encode(tok, ANSWER))
    counts = [f.num_reasoning_tokens for f in frames]
    assert counts == sorted(counts)  # a running total


def test_prompt_opened_thinking_counts_from_the_first_token(think_tokenizer):
    tok = think_tokenizer
    body = encode(tok, THINKING)
    ids = body + encode(tok, "</think>", ANSWER)
    # (The frontend reads from the prompt, or deepseek_r1's default, that the output starts
    # inside a thinking block.)
    for name in ("deepseek_r1", "qwen3"):
        params = OutputParams(reasoning_parser=name, starts_in_reasoning=True)
        assert run(tok, ids, params)[-1].num_reasoning_tokens == len(body), name


def test_unclosed_thinking_is_all_reasoning_and_no_thinking_is_none(think_tokenizer):
    tok = think_tokenizer
    body = encode(tok, THINKING)
    frames = run(tok, encode(tok, "<think>") + body, OutputParams(reasoning_parser="qwen3"))
    assert frames[-1].num_reasoning_tokens == len(body)
    answer = encode(tok, "Paris.")
    assert run(tok, answer, OutputParams(reasoning_parser="qwen3"))[-1].num_reasoning_tokens == 0
    # No reasoning parser: nothing counted, and usage will carry no details.
    assert run(tok, answer, OutputParams())[-1].num_reasoning_tokens is None


def test_two_sections_both_count(think_tokenizer):
    tok = think_tokenizer
    first, second = encode(tok, "first thought"), encode(tok, "second thought")
    ids = (encode(tok, "<think>") + first + encode(tok, "</think>", "Hm.", "<think>") + second
           + encode(tok, "</think>", "Done."))
    frames = run(tok, ids, OutputParams(reasoning_parser="qwen3"))
    assert "".join(f.reasoning for f in frames) == "first thoughtsecond thought"
    assert frames[-1].num_reasoning_tokens == len(first) + len(second)


def test_stop_string_in_the_answer(think_tokenizer):
    tok = think_tokenizer
    body = encode(tok, THINKING)
    ids = encode(tok, "<think>") + body + encode(tok, "</think>", " Paris. It is a city of art.")
    params = OutputParams(reasoning_parser="qwen3", stop=["city"], min_tokens=2)
    frames = run(tok, ids, params)
    assert "".join(f.text for f in frames) == "Paris. It is a "
    assert (frames[-1].finish_reason, frames[-1].stop_reason) == ("stop", "city")
    assert frames[-1].num_reasoning_tokens == len(body)


# ---------------------------------------------------------------- Harmony (gpt-oss)

ANALYSIS = "Need the weather. Paris is in France."
SECOND = "Still thinking."


def harmony_ids(tok):
    """analysis, a call to a built-in tool (reasoning too), another analysis message, a
    preamble, and the final answer; the turn ends with the <|return|> stop token."""
    bodies = [encode(tok, ANALYSIS), encode(tok, "print(1)"), encode(tok, SECOND)]
    ids = (encode(tok, "<|channel|>", "analysis", "<|message|>") + bodies[0]
           + encode(tok, "<|end|>", "<|start|>", "assistant", "<|channel|>",
                    "analysis to=python", "<|message|>") + bodies[1]
           + encode(tok, "<|call|>", "<|start|>", "assistant", "<|channel|>", "analysis",
                    "<|message|>") + bodies[2]
           + encode(tok, "<|end|>", "<|start|>", "assistant", "<|channel|>", "commentary",
                    "<|message|>", "Let me answer.", "<|end|>", "<|start|>", "assistant",
                    "<|channel|>", "final", "<|message|>", "It is sunny.", "<|return|>"))
    return ids, sum(len(b) for b in bodies)


@pytest.mark.parametrize("sizes_of", range(3))
def test_harmony_counts_only_reasoning_message_bodies(harmony_tok, sizes_of):
    ids, bodies = harmony_ids(harmony_tok)
    frames = run(harmony_tok, ids, OutputParams(reasoning_parser="openai_gptoss"),
                 splits(len(ids))[sizes_of], finish=("stop", None))
    assert "".join(f.reasoning for f in frames) == ANALYSIS + "print(1)" + SECOND
    assert "".join(f.text for f in frames) == "Let me answer.It is sunny."
    assert frames[-1].num_output_tokens == len(ids)
    assert frames[-1].num_reasoning_tokens == bodies


def test_harmony_tool_call_arguments_are_not_reasoning(harmony_tok):
    tok = harmony_tok
    analysis = encode(tok, ANALYSIS)
    ids = (encode(tok, "<|channel|>", "analysis", "<|message|>") + analysis
           + encode(tok, "<|end|>", "<|start|>", "assistant", "<|channel|>",
                    "commentary to=functions.get_weather", "<|constrain|>", "json",
                    "<|message|>", '{"city": "Paris"}', "<|call|>"))
    params = OutputParams(reasoning_parser="openai_gptoss", tool_parser="openai",
                          tools=b'[{"type": "function", "function": {"name": "get_weather"}}]')
    frames = run(tok, ids, params, finish=("stop", None))
    assert [c.function.name for f in frames for c in f.tool_calls
            if c.function and c.function.name] == ["get_weather"]
    assert frames[-1].num_reasoning_tokens == len(analysis)


def test_continuous_usage_chunks_carry_the_running_count(think_tokenizer):
    tok = think_tokenizer
    body = encode(tok, THINKING)
    ids = encode(tok, "<think>") + body + encode(tok, "</think>", ANSWER)
    fmt = ChunkFormat("chat", "chatcmpl-1", 0, "m", 0, continuous_usage=True)
    frames = run(tok, ids, OutputParams(reasoning_parser="qwen3", chunk=fmt))
    usages = [json.loads(f.chunk[len(b"data: "):])["usage"] for f in frames if f.chunk]
    counts = [u["completion_tokens_details"]["reasoning_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == len(body)
    # Without a reasoning parser the chunks' usage has no details (as before).
    plain = run(tok, ids, OutputParams(chunk=fmt))
    assert all("completion_tokens_details" not in json.loads(f.chunk[6:])["usage"]
               for f in plain if f.chunk)
