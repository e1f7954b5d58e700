"""The whole postproc step on real tokens of the default tokenizer: reasoning and tool-call
parsers in the pipeline (req O-5, O-6) and the chunk bytes it writes for streamed requests
(O-1, O-4), fed one token per engine step and checked against the non-streaming result."""

import json

import msgspec
import numpy as np
import pytest

from postproc.processor import OutputProcessor
from postproc.tool_parsers import ToolDelta, collect
from shared.protocol import ChunkFormat, OutputParams, RequestOutput, TokenLogprobs, pack_ids
from shared.tokenizer import load_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                           "properties": {"city": {"type": "string"}}}}}]
TOOL_ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}\n</tool_call>')
THINK_ANSWER = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def feed(tokenizer, answer: str, params: OutputParams, finish="stop", logprobs=False):
    """One token per step, as the engine sends them; the last step finishes."""
    processor = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("Hi", add_special_tokens=False)
    ids = tokenizer.encode(answer, add_special_tokens=False)
    if finish == "stop":  # the engine stops on EOS, the last token it sends
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    processor.register("r", prompt, params)
    frames = []
    for i, token in enumerate(ids):
        raw = None
        if logprobs:
            raw = TokenLogprobs(np.array([-0.5], dtype="<f4").tobytes())
        out = RequestOutput("r", pack_ids([token]), len(prompt), i + 1,
                            finish_reason=finish if i == len(ids) - 1 else None, logprobs=raw)
        frames.extend(processor.process([out]).frames)
    return frames


def events(frames) -> list[dict]:
    out = []
    for f in frames:
        if f.chunk:
            assert f.chunk.startswith(b"data: ") and f.chunk.endswith(b"\n\n")
            out.append(json.loads(f.chunk[6:]))
    return out


def chat_format(**extra) -> ChunkFormat:
    return ChunkFormat(kind="chat", response_id="chatcmpl-1", created=7, model="m", index=0,
                       **extra)


def test_tool_calls_come_out_of_the_pipeline_streamed_and_whole(tokenizer):
    params = OutputParams(tool_parser="hermes", tools=msgspec.json.encode(TOOLS),
                          chunk=chat_format())
    frames = feed(tokenizer, TOOL_ANSWER, params)
    assert "".join(f.text for f in frames) == "Let me check."
    calls = collect([ToolDelta("", [c for f in frames for c in f.tool_calls])]).calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert frames[-1].finish_reason == "tool_calls"
    # The chunks say the same thing, in OpenAI's streaming shape; no delimiter leaks.
    chunks = events(frames)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    streamed_calls = [t for d in deltas for t in d.get("tool_calls", [])]
    assert streamed_calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert streamed_calls[0]["id"].startswith("call_") and streamed_calls[0]["type"] == "function"
    # Then the arguments, in fragments as the model wrote them (one delta per chunk here).
    assert all(set(t) == {"index", "function"} for t in streamed_calls[1:])
    arguments = "".join(t["function"]["arguments"] for t in streamed_calls[1:])
    assert json.loads(arguments) == {"city": "Paris"} and len(streamed_calls) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("<tool_call>" not in json.dumps(c) for c in chunks)


def test_without_a_call_the_finish_stays_stop(tokenizer):
    params = OutputParams(tool_parser="hermes", tools=msgspec.json.encode(TOOLS))
    frames = feed(tokenizer, "It is sunny in Paris.", params)
    assert "".join(f.text for f in frames) == "It is sunny in Paris."
    assert frames[-1].finish_reason == "stop" and not any(f.tool_calls for f in frames)
    assert not any(f.chunk for f in frames)  # not streamed: no bytes written


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_is_split_into_the_configured_field(tokenizer, field):
    params = OutputParams(reasoning_parser="qwen3", chunk=chat_format(reasoning_field=field))
    frames = feed(tokenizer, THINK_ANSWER, params)
    assert "".join(f.reasoning for f in frames) == "The user greets me."
    assert "".join(f.text for f in frames) == "Hello! How can I help?"
    deltas = [c["choices"][0]["delta"] for c in events(frames)]
    assert "".join(d.get(field, "") for d in deltas) == "The user greets me."
    assert "".join(d.get("content", "") for d in deltas) == "Hello! How can I help?"
    other = "reasoning" if field == "reasoning_content" else "reasoning_content"
    assert not any(other in d for d in deltas)


def test_a_prompt_that_opened_the_think_block_starts_in_reasoning(tokenizer):
    params = OutputParams(reasoning_parser="qwen3", starts_in_reasoning=True)
    frames = feed(tokenizer, "still thinking\n</think>\n\nDone.", params)
    assert "".join(f.reasoning for f in frames) == "still thinking"
    assert "".join(f.text for f in frames) == "Done."


def test_reasoning_then_tool_call(tokenizer):
    params = OutputParams(reasoning_parser="qwen3", tool_parser="hermes",
                          tools=msgspec.json.encode(TOOLS))
    frames = feed(tokenizer, "<think>\nNeed weather.\n</think>\n\n" + TOOL_ANSWER, params)
    assert "".join(f.reasoning for f in frames) == "Need weather."
    assert "".join(f.text for f in frames) == "Let me check."
    assert sum(1 for f in frames for c in f.tool_calls if c.id) == 1
    assert frames[-1].finish_reason == "tool_calls"


def test_held_back_text_keeps_its_logprobs_for_the_next_chunk(tokenizer):
    """A stop string's possible start is held back; its tokens' logprobs ride along with the
    next chunk that has text, so the chunks carry one entry per token."""
    answer = "one two three four"
    params = OutputParams(stop=["three four five"], logprobs=True,
                          chunk=chat_format(logprobs=True))
    frames = feed(tokenizer, answer, params, finish="length", logprobs=True)
    chunks = events(frames)
    entries = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(entries) == len(tokenizer.encode(answer, add_special_tokens=False))
    assert len(chunks) < len(frames)  # some frames were held back
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == answer


def test_completion_chunks_echo_and_count_usage(tokenizer):
    fmt = ChunkFormat(kind="completion", response_id="cmpl-1", created=7, model="m", index=3,
                      echo="Hi", continuous_usage=True)
    frames = feed(tokenizer, " there, friend.", OutputParams(chunk=fmt), finish="length")
    chunks = events(frames)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hi there, friend."
    assert chunks[0]["choices"][0]["text"].startswith("Hi")
    assert all(c["object"] == "text_completion" and c["choices"][0]["index"] == 3
               for c in chunks)
    usage = [c["usage"]["completion_tokens"] for c in chunks]
    assert usage == sorted(usage) and usage[-1] == len(frames)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_held_back_tokens_keep_their_ids_for_the_next_chunk(tokenizer):
    """return_token_ids: ids ride with logprobs while a stop string holds text back, and a
    completion's first written chunk names the prompt, however many frames were held."""
    answer = "one two three four"
    fmt = ChunkFormat(kind="completion", response_id="cmpl-1", created=7, model="m", index=0,
                      token_ids=True)
    frames = feed(tokenizer, answer, OutputParams(stop=["one two three four five"], chunk=fmt),
                  finish="length")
    chunks = events(frames)
    assert len(chunks) < len(frames)  # the first frames were held back
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"] == tokenizer.encode("Hi", add_special_tokens=False)
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == tokenizer.encode(
        answer, add_special_tokens=False)
    # Without return_token_ids, chat chunks have no such field at all.
    chat = events(feed(tokenizer, answer, OutputParams(chunk=chat_format()), finish="length"))
    assert all("token_ids" not in c["choices"][0] for c in chat)


def test_a_tool_call_nested_past_pythons_recursion_limit_is_content(tokenizer):
    """Model output can nest deeper than json.loads can recurse (RecursionError, not a
    ValueError); such a call is not a call, and its text comes back as content."""
    deep = "[" * 3000 + "]" * 3000
    answer = '<tool_call>\n{"name": "get_weather", "arguments": ' + deep + "}\n</tool_call>"
    for chunk in (chat_format(), None):
        params = OutputParams(tool_parser="hermes", tools=msgspec.json.encode(TOOLS),
                              chunk=chunk)
        frames = feed(tokenizer, answer, params)
        assert frames[-1].finish_reason == "stop" and not any(f.tool_calls for f in frames)
        assert deep in "".join(f.text for f in frames)


def test_a_request_whose_output_fails_to_process_ends_alone(tokenizer, monkeypatch):
    """A fault in one request's output processing (here a parser that raises) ends that
    request with an error, tells the engine to stop it, and leaves the batch's other
    requests going: the worker or receiver thread does not die with it."""
    from postproc.tool_parsers.hermes import HermesToolParser

    def broken(self, text):
        raise KeyError("parser bug")

    monkeypatch.setattr(HermesToolParser, "feed", broken)
    processor = OutputProcessor(tokenizer)
    processor.register("bad", [1], OutputParams(tool_parser="hermes",
                                                tools=msgspec.json.encode(TOOLS)))
    processor.register("good", [1], OutputParams())
    token = tokenizer.encode("Hello", add_special_tokens=False)
    result = processor.process([RequestOutput("bad", pack_ids(token), 1, 1),
                                RequestOutput("good", pack_ids(token), 1, 1)])
    bad, good = result.frames
    assert bad.finish_reason == "error" and bad.error_status == 500 and "KeyError" in bad.error
    assert result.stopped_early == ["bad"] and len(processor) == 1
    assert good.finish_reason is None and good.text == "Hello"
    more = processor.process([RequestOutput("good", pack_ids(token), 1, 2,
                                            finish_reason="length")])
    assert more.frames[0].text == "Hello" and len(processor) == 0


def test_an_echoed_completion_stream_names_only_generated_ids(tokenizer):
    """As vLLM: with echo the first chunk's text starts with the prompt, and it names the
    prompt's ids in prompt_token_ids, never among its token_ids."""
    fmt = ChunkFormat(kind="completion", response_id="cmpl-1", created=7, model="m", index=0,
                      echo="Hi", token_ids=True)
    answer = " there, friend."
    choices = [c["choices"][0] for c in events(feed(tokenizer, answer, OutputParams(chunk=fmt),
                                                    finish="length"))]
    assert choices[0]["text"].startswith("Hi")
    assert choices[0]["prompt_token_ids"] == tokenizer.encode("Hi", add_special_tokens=False)
    assert [t for c in choices for t in c["token_ids"]] == tokenizer.encode(
        answer, add_special_tokens=False)
