"""Turns the engine's token batches into text frames, one request state per request.

Per frame: detokenize, match stop strings, split reasoning from content, parse tool calls,
and, for streamed requests, write the OpenAI chunk bytes. The same code runs in a postproc
worker (the fleet) or in a frontend's receiver thread when no fleet is configured; either way
it is off the engine and off the HTTP event loop (req S-4).

A request's frames are a pure function of its EngineRequest and its outputs, in order: frame
k comes from the k-th output. So a dead worker's requests replay on another worker, which
produces the same frames, and the frontend drops the ones it already has. A request moved to
another engine mid-stream (`Continuation`) starts by replaying the frames the client already
has from the tokens it carries, unsent: its detokenizer, stop matcher, parsers and chunk
writer then stand where the client's stream stopped, and its next frame number follows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import msgspec

from postproc.chunks import ChunkWriter, Piece
from postproc.detokenizer import IncrementalDetokenizer
from postproc.logprobs import TokenTexts, logprob_entries, token_id_name
from postproc.reasoning import get_reasoning_parser
from postproc.reasoning.counting import CountingReader
from postproc.stop_strings import StopMatcher
from postproc.tool_parsers import ToolDelta, ToolParser, get_tool_parser
from shared.protocol import Continuation, OutputParams, RequestOutput, TextFrame, unpack_ids

_log = logging.getLogger(__name__)


class Registration(msgspec.Struct):
    """A request known but not yet seen producing output: its state is built on first use,
    so a frontend whose requests a postproc worker handles pays nothing per request."""

    prompt_ids: Sequence[int]
    params: OutputParams
    continuation: Continuation | None = None
    timed: bool = False  # traced: its state keeps `PhaseTimes`


class PhaseTimes(msgspec.Struct):
    """A traced request's time in each postproc phase (postproc.tracing makes its span)."""

    detokenize_s: float = 0.0  # detokenizing and stop strings
    parse_s: float = 0.0  # the reasoning and tool-call parsers
    frames: int = 0
    first_frame_at: float = 0.0  # time.time() of its first frame

    def add(self, started: float, detokenized: float, parsed: float) -> None:
        if not self.frames:
            self.first_frame_at = time.time()
        self.frames += 1
        self.detokenize_s += detokenized - started
        self.parse_s += parsed - detokenized


class RequestState(msgspec.Struct):
    prompt_ids: Sequence[int]
    params: OutputParams
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher | None
    reasoning: CountingReader | None  # the reasoning parser, counting its tokens
    tools: ToolParser | None
    writer: ChunkWriter | None
    next_seq: int = 0
    timing: PhaseTimes | None = None


class Processed(msgspec.Struct):
    frames: list[TextFrame]
    # Requests a stop string finished while the engine still runs them: abort them there.
    stopped_early: list[str]
    # Traced requests that finished in this batch: their phase times.
    timings: dict[str, PhaseTimes] = msgspec.field(default_factory=dict)


class OutputProcessor:
    """Thread-safe: requests are registered from one thread and processed on another."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts = TokenTexts(tokenizer)
        # (reasoning parser, tool parser) -> the special tokens to skip for such a request.
        self._skips: dict[tuple[str | None, str | None], frozenset[int] | None] = {}
        self._states: dict[str, RequestState | Registration] = {}
        self._lock = threading.Lock()

    def register(
        self, request_id: str, prompt_token_ids: Sequence[int], params: OutputParams,
        continuation: Continuation | None = None, timed: bool = False,
    ) -> None:
        with self._lock:
            self._states[request_id] = Registration(prompt_token_ids, params, continuation,
                                                    timed)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._states.pop(request_id, None)

    def clear(self) -> None:
        with self._lock:
            self._states.clear()

    def __len__(self) -> int:
        return len(self._states)

    def process(self, outputs: Sequence[RequestOutput]) -> Processed:
        result = Processed([], [])
        for output in outputs:
            state = None
            try:
                state = self._state(output.request_id)
                if state is None:
                    continue  # the frontend gave up on it, or a stop string already ended it
                frame = self._frame(state, output, output.request_id)
            except Exception as exc:  # noqa: BLE001 - one request's output must not stop the rest
                frame = _failed_frame(state.next_seq if state else 0, output, exc)
            if frame.finish_reason is not None:
                self.discard(output.request_id)
                if state is not None and state.timing is not None:
                    result.timings[output.request_id] = state.timing
                if output.finish_reason is None:
                    result.stopped_early.append(output.request_id)
            result.frames.append(frame)
        return result

    def _state(self, request_id: str) -> RequestState | None:
        with self._lock:
            state = self._states.get(request_id)
            if isinstance(state, Registration):
                state = self._build(request_id, state)
                self._states[request_id] = state
        return state

    def _build(self, request_id: str, spec: Registration) -> RequestState:
        params = spec.params
        reasoning = None
        if params.reasoning_parser:
            reasoning = CountingReader(get_reasoning_parser(params.reasoning_parser).starting(
                params.starts_in_reasoning))
        tools = None
        if params.tool_parser:
            declared = msgspec.json.decode(params.tools) if params.tools else None
            tools = get_tool_parser(params.tool_parser)(
                declared, call_id_seed=request_id, prefill=params.tool_prefill)
        state = RequestState(
            prompt_ids=spec.prompt_ids,
            params=params,
            detokenizer=self._detokenizer(spec.prompt_ids, params, reasoning is not None,
                                          tools is not None),
            stops=(StopMatcher(params.stop, params.include_stop_str_in_output)
                   if params.stop else None),
            reasoning=reasoning,
            tools=tools,
            writer=(ChunkWriter(params.chunk, spec.prompt_ids)
                    if params.chunk is not None else None),
            timing=PhaseTimes() if spec.timed else None,
        )
        if spec.continuation is not None:
            self._replay(state, spec.continuation, request_id)
        return state

    def _replay(self, state: RequestState, continuation: Continuation, request_id: str) -> None:
        """Runs the frames the client already has through `state`, dropping them."""
        ids = unpack_ids(continuation.output_token_ids)
        done = 0
        for size in continuation.frame_sizes:
            chunk = ids[done:done + size]
            done += size
            self._frame(state, RequestOutput(
                request_id=request_id, new_token_ids=chunk.tobytes(),
                num_prompt_tokens=len(state.prompt_ids), num_output_tokens=done), request_id)

    def _detokenizer(self, prompt_ids, params: OutputParams, reasoning: bool,
                     tools: bool) -> IncrementalDetokenizer:
        """skip_special_tokens as the request says, except for the delimiters of its
        parsers that are special tokens (`[TOOL_CALLS]`, `<|python_tag|>`): those reach the
        parser, which takes them out, and every other special token is still skipped."""
        skip = None
        if params.skip_special_tokens and (reasoning or tools):
            key = (params.reasoning_parser if reasoning else None,
                   params.tool_parser if tools else None)
            if key not in self._skips:
                self._skips[key] = special_ids_to_skip(self._tokenizer, *key)
            skip = self._skips[key]
        if skip is None:
            return IncrementalDetokenizer(self._tokenizer, prompt_ids,
                                          skip_special_tokens=params.skip_special_tokens)
        return IncrementalDetokenizer(self._tokenizer, prompt_ids, skip_special_tokens=False,
                                      skip_ids=skip)

    def _frame(self, state: RequestState, output: RequestOutput, request_id: str) -> TextFrame:
        ids = unpack_ids(output.new_token_ids)
        started = time.perf_counter()
        text, finish_reason, stop_reason = self._text(state, output, ids)
        detokenized = time.perf_counter()
        finished = finish_reason is not None and finish_reason != "error"
        reasoning, content, calls = self._parse(state, text, finished,
                                                truncated=finish_reason == "length")
        if state.timing is not None:
            state.timing.add(started, detokenized, time.perf_counter())
        if finish_reason == "stop" and state.tools is not None and state.tools.num_calls:
            finish_reason = "tool_calls"  # as OpenAI says when the answer called tools
        logprobs = self._entries(state, ids, output.logprobs)
        prompt_logprobs = self._entries(state, state.prompt_ids, output.prompt_logprobs)
        # Counted only for requests that run a reasoning parser (None: usage has no details).
        reasoning_tokens = (state.reasoning.reasoning_tokens if state.reasoning is not None
                            else None)
        chunk = b""
        if state.writer is not None and finish_reason != "error":
            ids_list = ids.tolist() if state.writer.fmt.token_ids else []
            chunk = state.writer.write(Piece(
                content, reasoning, calls, logprobs or [], prompt_logprobs, ids_list,
                finish_reason, stop_reason, output.num_prompt_tokens, output.num_output_tokens,
                reasoning_tokens,
            ))
        frame = TextFrame(
            request_id=request_id,
            seq=state.next_seq,
            text=content,
            token_ids=output.new_token_ids,
            num_prompt_tokens=output.num_prompt_tokens,
            num_output_tokens=output.num_output_tokens,
            num_reasoning_tokens=reasoning_tokens,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            error=output.error,
            error_status=output.error_status,
            first_token_time=output.first_token_time,
            num_cached_tokens=output.num_cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cumulative_logprob=output.cumulative_logprob,
            reasoning=reasoning,
            tool_calls=calls,
            chunk=chunk,
            pooled=output.pooled,
        )
        state.next_seq += 1
        return frame

    def _text(self, state: RequestState, output: RequestOutput, ids):
        """Detokenized new text after stop strings, and the finish it leads to. With a
        reasoning parser, its counting reader also gets each token's text before stop
        strings (to tell the reasoning tokens)."""
        finished = output.finish_reason is not None
        text_ids = ids
        if (output.finish_reason == "stop" and len(ids)
                and not state.params.include_stop_str_in_output):
            # The engine stops with "stop" only on EOS or a stop_token_id, the last token:
            # like a stop string, it is left out of the text unless asked for (req O-3).
            text_ids = ids[:-1]
        # The first min_tokens tokens cannot end the output with a stop string (req P-9:
        # the min_tokens gate comes first, as for EOS and stop_token_ids in the engine).
        gated = max(0, min(len(text_ids),
                           state.params.min_tokens - (output.num_output_tokens - len(ids))))
        ids_list = text_ids.tolist()
        if state.reasoning is not None:
            texts = [(state.detokenizer.push([i]), 1) for i in ids_list]
            if finished:
                texts.append((state.detokenizer.flush(), 0))
            state.reasoning.tokens(texts)
            early = "".join(t for t, _ in texts[:gated])
            text = "".join(t for t, _ in texts[gated:])
        else:
            early = state.detokenizer.push(ids_list[:gated]) if gated else ""
            text = state.detokenizer.push(ids_list[gated:]) if len(ids_list) > gated else ""
            if finished:
                text += state.detokenizer.flush()
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if state.stops is not None and finish_reason != "error":
            if gated:
                early, _ = state.stops.feed(early, gated=True)
            text, matched = state.stops.feed(text)
            text = early + text
            if matched is not None:
                finish_reason, stop_reason = "stop", matched
            elif finished:
                text += state.stops.flush()
        else:
            text = early + text
        return text, finish_reason, stop_reason

    @staticmethod
    def _parse(state: RequestState, text: str, finished: bool, *, truncated: bool = False):
        """(reasoning, content, tool-call deltas) of the new text; flushes at the end.
        `truncated`: the output ran out of tokens (a call it was writing is unfinished)."""
        reasoning, content = "", text
        if state.reasoning is not None:
            d = state.reasoning.feed(text)
            reasoning, content = d.reasoning, d.content
            if finished:
                d = state.reasoning.finish()
                reasoning, content = reasoning + d.reasoning, content + d.content
        if state.tools is None:
            return reasoning, content, []
        parts: list[ToolDelta] = [state.tools.feed(content)]
        if finished:
            parts.append(state.tools.finish(truncated=truncated))
        return (reasoning, "".join(p.content for p in parts),
                [c for p in parts for c in p.calls])

    def _entries(self, state: RequestState, ids, raw):
        if raw is None:
            return None
        texts = token_id_name if state.params.tokens_as_ids else self._texts
        return logprob_entries(ids, raw, texts)


def _delimiters(reasoning_parser: str | None, tool_parser: str | None) -> set[str]:
    delimiters: set[str] = set()
    if reasoning_parser:
        cls = get_reasoning_parser(reasoning_parser)
        delimiters |= {cls.start_tag, cls.end_tag, *cls.delimiters}
    if tool_parser:
        delimiters |= set(get_tool_parser(tool_parser).delimiters)
    return delimiters


def special_ids_to_skip(
    tokenizer, reasoning_parser: str | None, tool_parser: str | None
) -> frozenset[int] | None:
    """For a request with these parsers that skips special tokens: the special token ids to
    skip, which are all but the parsers' delimiters; None when no delimiter is special (a
    plain skip_special_tokens decode does)."""
    delimiters = _delimiters(reasoning_parser, tool_parser)
    special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if not delimiters & set(special.values()):
        return None
    return frozenset(i for i, content in special.items() if content not in delimiters)


def _failed_frame(seq: int, output: RequestOutput, exc: Exception) -> TextFrame:
    """The last frame of a request whose output could not be processed (a bug or output no
    parser survives): it ends with an error, and the engine stops generating it, while every
    other request in the batch goes on."""
    _log.exception("processing the output of %s failed", output.request_id,
                   extra={"request_id": output.request_id})
    return TextFrame(
        request_id=output.request_id, seq=seq, text="",
        token_ids=output.new_token_ids, num_prompt_tokens=output.num_prompt_tokens,
        num_output_tokens=output.num_output_tokens, finish_reason="error",
        error=f"the server could not process this request's output ({type(exc).__name__})",
        error_status=500,
    )
