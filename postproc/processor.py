"""Turns the engine's token batches into text frames, one request state per request.

The same code runs in a postproc worker (the fleet) or in a frontend's receiver thread when
no fleet is configured; either way it is off the engine and off the HTTP event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import msgspec

from postproc.detokenizer import IncrementalDetokenizer
from shared.protocol import OutputBatch, RequestOutput, TextFrame, unpack_ids


class RequestState(msgspec.Struct):
    detokenizer: IncrementalDetokenizer
    next_seq: int = 0


class OutputProcessor:
    """Thread-safe: requests are registered from one thread and processed on another."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()

    def register(
        self, request_id: str, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        detokenizer = IncrementalDetokenizer(
            self._tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        with self._lock:
            self._states[request_id] = RequestState(detokenizer)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._states.pop(request_id, None)

    def process(self, batch: OutputBatch) -> list[TextFrame]:
        frames = []
        for output in batch.outputs:
            with self._lock:
                state = self._states.get(output.request_id)
                if state is not None and output.finish_reason is not None:
                    del self._states[output.request_id]
            if state is not None:  # None: the frontend gave up on it already
                frames.append(self._frame(state, output))
        return frames

    @staticmethod
    def _frame(state: RequestState, output: RequestOutput) -> TextFrame:
        ids = unpack_ids(output.new_token_ids)
        text = state.detokenizer.push(ids.tolist()) if len(ids) else ""
        if output.finish_reason is not None:
            text += state.detokenizer.flush()
        frame = TextFrame(
            request_id=output.request_id,
            seq=state.next_seq,
            text=text,
            token_ids=output.new_token_ids,
            num_prompt_tokens=output.num_prompt_tokens,
            num_output_tokens=output.num_output_tokens,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            error=output.error,
            error_status=output.error_status,
            first_token_time=output.first_token_time,
        )
        state.next_seq += 1
        return frame
