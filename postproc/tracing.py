"""A postproc worker's span of a traced request (`postproc`), under the frontend's span
that `EngineRequest.trace_context` names: from the worker's assignment to the request's
last frame, with the time it spent detokenizing (and matching stop strings) and parsing
(reasoning and tool calls), which the processor sums per frame (`PhaseTimes`). One
`SpanData` per request goes to the tracing thread (`shared.tracing`) at its end.
"""

from __future__ import annotations

import time

import msgspec

from postproc.processor import PhaseTimes, Processed
from shared.protocol import EngineRequest, OutputParams, TextFrame
from shared.trace_context import TraceParent, from_wire
from shared.tracing import SpanData, SpanEvent, Tracing, tracing

SPAN_NAME = "postproc"


class Opened(msgspec.Struct):
    parent: TraceParent
    started: float
    params: OutputParams


class PostprocTraces:
    def __init__(self, sink: Tracing, worker_id: str) -> None:
        self.sink = sink
        self.worker_id = worker_id
        self._open: dict[str, Opened] = {}

    def assigned(self, request: EngineRequest) -> bool:
        """True when the request is traced (a well-formed, sampled context; a malformed
        one is simply not traced)."""
        parent = from_wire(request.trace_context)
        if parent is None or not parent.sampled:
            return False
        self._open[request.request_id] = Opened(parent, time.time(), request.output)
        return True

    def forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def finished(self, processed: Processed) -> None:
        stopped = set(processed.stopped_early)
        for frame in processed.frames:
            if frame.finish_reason is None:
                continue
            opened = self._open.pop(frame.request_id, None)
            if opened is not None:
                self._emit(opened, frame, processed.timings.get(frame.request_id),
                           frame.request_id in stopped)

    def _emit(self, opened: Opened, frame: TextFrame, timing: PhaseTimes | None,
              stopped_early: bool) -> None:
        now = time.time()
        timing = timing or PhaseTimes()
        params = opened.params
        attributes = {
            "gen_ai.request.id": frame.request_id,
            "gen_ai.usage.input_tokens": frame.num_prompt_tokens,
            "gen_ai.usage.output_tokens": frame.num_output_tokens,
            "gen_ai.response.finish_reasons": [frame.finish_reason],
            "sluice.postproc.worker_id": self.worker_id,
            "sluice.postproc.frames": timing.frames,
            "sluice.postproc.detokenize_seconds": timing.detokenize_s,
            "sluice.postproc.parse_seconds": timing.parse_s,
            "sluice.postproc.streamed": params.chunk is not None,
            "sluice.postproc.stop_string": stopped_early,
        }
        if params.reasoning_parser:
            attributes["sluice.postproc.reasoning_parser"] = params.reasoning_parser
        if params.tool_parser:
            attributes["sluice.postproc.tool_parser"] = params.tool_parser
        if frame.num_reasoning_tokens is not None:
            attributes["sluice.usage.reasoning_tokens"] = frame.num_reasoning_tokens
        events = [SpanEvent("first_frame", timing.first_frame_at)] if timing.frames else []
        if stopped_early:
            events.append(SpanEvent("stop_string", now))
        self.sink.emit(SpanData(
            SPAN_NAME, opened.parent, opened.started, now, attributes, events,
            error=frame.error if frame.finish_reason == "error" else None, kind="consumer"))


def postproc_traces(worker_id: str) -> PostprocTraces | None:
    """The worker's tracer when this process traces (shared.tracing.start_tracing)."""
    sink = tracing()
    return PostprocTraces(sink, worker_id) if sink is not None else None
