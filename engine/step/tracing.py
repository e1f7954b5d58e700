"""The engine's span of a traced request (`llm_request`, vLLM's name), under the span the
frontend put in `EngineRequest.trace_context`.

Nothing is written per token or per step: the step loop stamps a counter per prefill chunk
and a time per preemption on the request's `RequestTrace`, the phase times are the ones
the engine's histograms already keep on the `Sequence`, and when the request ends one
`SpanData` goes to the tracing thread (`shared.tracing`), which builds and exports it.
"""

from __future__ import annotations

import time

from engine.request.records import RequestTrace
from engine.request.sequence import Sequence
from shared.protocol import EngineRequest
from shared.trace_context import from_wire
from shared.tracing import SpanData, SpanEvent, Tracing, tracing

SPAN_NAME = "llm_request"


class EngineTraces:
    def __init__(self, sink: Tracing, engine_id: str, model_name: str) -> None:
        self.sink = sink
        self.engine_id = engine_id
        self.model_name = model_name

    def start(self, seq: Sequence, request: EngineRequest) -> None:
        """Marks a new request as traced when its context is well formed and sampled (a
        malformed one is a request without a trace, never an error)."""
        parent = from_wire(request.trace_context)
        if parent is None or not parent.sampled:
            return
        resumed = request.continuation
        seq.trace = RequestTrace(parent, resumed_tokens=(
            len(resumed.output_token_ids) // 4 if resumed is not None else 0))

    def finished(self, seq: Sequence) -> None:
        trace = seq.trace
        seq.trace = None  # one span per request, whichever way it ends
        now = time.time()
        error = seq.error if seq.finish_reason == "error" else None
        self.sink.emit(SpanData(
            SPAN_NAME, trace.parent, seq.queued_time, now, self._attributes(seq, trace, now),
            _events(seq, trace, now), error=error, kind="server"))

    def rejected(self, request: EngineRequest, message: str, status: int) -> None:
        """A request refused at admission: a span that says why."""
        parent = from_wire(request.trace_context)
        if parent is None or not parent.sampled:
            return
        now = time.time()
        self.sink.emit(SpanData(SPAN_NAME, parent, now, now, {
            "gen_ai.request.id": request.request_id, "sluice.engine.id": self.engine_id,
            "gen_ai.response.finish_reasons": ["error"], "sluice.error.status": status,
        }, error=message, kind="server"))

    def _attributes(self, seq: Sequence, trace: RequestTrace, now: float) -> dict:
        params = seq.params
        attributes = {
            "gen_ai.request.id": seq.request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": seq.num_prompt_tokens,
            "gen_ai.usage.output_tokens": seq.num_output_tokens,
            # vLLM's older names, which its dashboards read.
            "gen_ai.usage.prompt_tokens": seq.num_prompt_tokens,
            "gen_ai.usage.completion_tokens": seq.num_output_tokens,
            "gen_ai.response.finish_reasons": [seq.finish_reason or "abort"],
            "gen_ai.latency.e2e": now - seq.arrival_time,
            "sluice.engine.id": self.engine_id,
            "sluice.prefill.chunks": trace.prefill_chunks,
            "sluice.preemptions": len(trace.preempted_at),
        }
        if params.top_k:
            attributes["gen_ai.request.top_k"] = params.top_k
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        if seq.num_cached_tokens is not None:
            attributes["sluice.prefix_cache.hit_tokens"] = seq.num_cached_tokens
        if trace.resumed_tokens:
            attributes["sluice.migration.resumed_tokens"] = trace.resumed_tokens
        if seq.pooling is not None:
            attributes["sluice.pooling.task"] = seq.pooling.task
        attributes.update(_latencies(seq))
        return attributes


def _latencies(seq: Sequence) -> dict:
    """vLLM's per-request latency attributes, from the phase times the engine keeps."""
    out = {}
    if seq.scheduled_time is not None:
        out["gen_ai.latency.time_in_queue"] = seq.scheduled_time - seq.queued_time
    if seq.first_token_time is not None:
        out["gen_ai.latency.time_to_first_token"] = seq.first_token_time - seq.arrival_time
        if seq.scheduled_time is not None:
            out["gen_ai.latency.time_in_model_prefill"] = (seq.first_token_time
                                                           - seq.scheduled_time)
            out["gen_ai.latency.time_in_model_inference"] = (seq.last_token_time
                                                             - seq.scheduled_time)
        out["gen_ai.latency.time_in_model_decode"] = seq.last_token_time - seq.first_token_time
    return out


def _events(seq: Sequence, trace: RequestTrace, now: float) -> list[SpanEvent]:
    events = []
    if trace.resumed_tokens:
        events.append(SpanEvent("migrated_in", seq.queued_time,
                                {"sluice.migration.resumed_tokens": trace.resumed_tokens}))
    if seq.scheduled_time is not None:
        events.append(SpanEvent("scheduled", seq.scheduled_time,
                                {"sluice.prefix_cache.hit_tokens": seq.num_cached_tokens or 0}))
    events += [SpanEvent("preempted", t) for t in trace.preempted_at]
    if seq.first_token_time is not None:
        events.append(SpanEvent("first_token", seq.first_token_time,
                                {"sluice.prefill.chunks": trace.prefill_chunks}))
    events.append(SpanEvent("finished", now, {"finish_reason": seq.finish_reason or "abort"}))
    return events


def note_chunk(seq: Sequence) -> None:
    """A scheduled chunk of a traced request: counted when it is prefill (more than the one
    token a decode feeds, or the first token still to come)."""
    if seq.num_computed < len(seq.token_ids) - 1 or seq.first_token_time is None:
        seq.trace.prefill_chunks += 1


def engine_traces(engine_id: str, model_name: str) -> EngineTraces | None:
    """The engine's tracer when this process traces (shared.tracing.start_tracing), else
    None: an untraced engine checks one attribute per request, nothing per step."""
    sink = tracing()
    return EngineTraces(sink, engine_id, model_name) if sink is not None else None
