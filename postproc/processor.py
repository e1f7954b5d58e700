"""Turns the engine's token batches into text frames, one request state per request.

The same code runs in a postproc worker (the fleet) or in a frontend's receiver thread when
no fleet is configured; either way it is off the engine and off the HTTP event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec

from postproc.detokenizer import IncrementalDetokenizer
from postproc.logprobs import TokenTexts, logprob_entries
from postproc.stop_strings import StopMatcher
from shared.protocol import OutputBatch, OutputParams, RequestOutput, TextFrame, unpack_ids


class RequestState(msgspec.Struct):
    prompt_ids: Sequence[int]
    params: OutputParams
    detokenizer: IncrementalDetokenizer
    stops: StopMatcher | None
    next_seq: int = 0


class Processed(msgspec.Struct):
    frames: list[TextFrame]
    # Requests a stop string finished while the engine still runs them: abort them there.
    stopped_early: list[str]


class OutputProcessor:
    """Thread-safe: requests are registered from one thread and processed on another."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts = TokenTexts(tokenizer)
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()

    def register(
        self, request_id: str, prompt_token_ids: Sequence[int], params: OutputParams
    ) -> None:
        detokenizer = IncrementalDetokenizer(
            self._tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        stops = StopMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        with self._lock:
            self._states[request_id] = RequestState(prompt_token_ids, params, detokenizer, stops)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._states.pop(request_id, None)

    def process(self, batch: OutputBatch) -> Processed:
        result = Processed([], [])
        for output in batch.outputs:
            with self._lock:
                state = self._states.get(output.request_id)
            if state is None:
                continue  # the frontend gave up on it, or a stop string already ended it
            frame = self._frame(state, output)
            if frame.finish_reason is not None:
                self.discard(output.request_id)
                if output.finish_reason is None:
                    result.stopped_early.append(output.request_id)
            result.frames.append(frame)
        return result

    def _frame(self, state: RequestState, output: RequestOutput) -> TextFrame:
        ids = unpack_ids(output.new_token_ids)
        finished = output.finish_reason is not None
        text_ids = ids
        if (output.finish_reason == "stop" and len(ids)
                and not state.params.include_stop_str_in_output):
            # The engine stops with "stop" only on EOS or a stop_token_id, the last token:
            # like a stop string, it is left out of the text unless asked for (SPEC O-3).
            text_ids = ids[:-1]
        text = state.detokenizer.push(text_ids.tolist()) if len(text_ids) else ""
        if finished:
            text += state.detokenizer.flush()
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if state.stops is not None and finish_reason != "error":
            text, matched = state.stops.feed(text)
            if matched is not None:
                finish_reason, stop_reason = "stop", matched
            elif finished:
                text += state.stops.flush()
        frame = TextFrame(
            request_id=output.request_id,
            seq=state.next_seq,
            text=text,
            token_ids=output.new_token_ids,
            num_prompt_tokens=output.num_prompt_tokens,
            num_output_tokens=output.num_output_tokens,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            error=output.error,
            error_status=output.error_status,
            first_token_time=output.first_token_time,
            logprobs=self._entries(ids, output.logprobs),
            prompt_logprobs=self._entries(state.prompt_ids, output.prompt_logprobs),
            cumulative_logprob=output.cumulative_logprob,
        )
        state.next_seq += 1
        return frame

    def _entries(self, ids, raw):
        if raw is None:
            return None
        return logprob_entries(ids, raw, self._texts)
