"""The frontend's spans, when tracing is on (`shared.tracing`): one server span per HTTP
request, child spans for its render, tokenize and submit to an engine, and the context the
engine and the postproc worker put their spans under.

`TracingMiddleware` (outermost, `frontend.http.app`) starts the span: the request's W3C
`traceparent` (and `tracestate`) is its parent, or it starts a trace; the response names it
in its own `traceparent` header. The span rides in a context variable, so the pipeline's
hooks here (`phase`, `note_job`, `note_frame`, `engine_context`) find it and do nothing
when there is none: a frontend without tracing never imports OpenTelemetry.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar

from shared import log_format
from shared.config import OPEN_PATHS
from shared.protocol import TextFrame, TraceContext
from shared.trace_context import format_traceparent, from_headers
from shared.tracing import Tracing

_current: ContextVar[RequestSpan | None] = ContextVar("sluice_request_span", default=None)

OPERATIONS = {"chat": "chat", "completions": "text_completion"}


class RequestSpan:
    """One HTTP request's span and what its answer adds to it."""

    def __init__(self, sink: Tracing, span) -> None:
        self.sink = sink
        self.span = span
        self.started = time.time()
        # A background response's work outlives its request's span: it still carries the
        # span's context on, but writes nothing more to it.
        self.ended = False
        self.first_token = False
        self.output_tokens: dict[int, int] = {}  # candidate number -> its output tokens
        self.finish_reasons: dict[int, str] = {}

    def child(self, name: str):
        from opentelemetry import trace

        return self.sink.tracer.start_span(name, context=trace.set_span_in_context(self.span))

    def frame(self, number: int, frame: TextFrame) -> None:
        if self.ended:
            return
        if not self.first_token and frame.num_output_tokens:
            self.first_token = True
            self.span.add_event("first_token")
            self.span.set_attribute("gen_ai.latency.time_to_first_token",
                                    time.time() - self.started)
        self.output_tokens[number] = frame.num_output_tokens
        if frame.finish_reason is not None:
            self.finish_reasons[number] = frame.finish_reason

    def close(self, status: int, route: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        span = self.span
        span.set_attribute("http.response.status_code", status)
        if route and span.is_recording():  # an unsampled span has no name to change
            span.update_name(f"{span.name.split(' ', 1)[0]} {route}")
            span.set_attribute("http.route", route)
        if self.finish_reasons:
            span.set_attribute("gen_ai.usage.output_tokens", sum(self.output_tokens.values()))
            span.set_attribute("gen_ai.response.finish_reasons",
                               [self.finish_reasons[n] for n in sorted(self.finish_reasons)])
            span.set_attribute("gen_ai.latency.e2e", time.time() - self.started)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        self.ended = True
        span.end()


class TracingMiddleware:
    """A server span around every HTTP request (refusals too: it sits outermost)."""

    def __init__(self, app, sink: Tracing) -> None:
        self.app = app
        self.sink = sink

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)  # probes and scrapes: no traces
        with request_span(self.sink, f"{scope['method']} {scope['path']}",
                          from_headers(scope["headers"]), {
                              "http.request.method": scope["method"],
                              "url.path": scope["path"]}) as traced:
            status = [500]  # what the client got, should the app raise before answering
            header = _traceparent_header(traced.span)

            async def send_traced(message) -> None:
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                    message = {**message, "headers": [*message.get("headers", []), header]}
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            except Exception as exc:
                traced.span.record_exception(exc)
                raise
            finally:
                route = scope.get("route")
                traced.close(status[0], getattr(route, "path", None))


@contextmanager
def request_span(sink: Tracing, name: str, parent, attributes: dict):
    """A server span as the current request's, for the block (the caller closes it)."""
    from opentelemetry.trace import SpanKind

    span = sink.tracer.start_span(name, context=sink.context(parent), kind=SpanKind.SERVER,
                                  attributes=attributes)
    traced = RequestSpan(sink, span)
    token = _current.set(traced)
    # --log-format json: the request's log lines name its trace (shared.log_format).
    log_token = log_format.trace_id.set(format(span.get_span_context().trace_id, "032x"))
    try:
        yield traced
    finally:
        log_format.trace_id.reset(log_token)
        _current.reset(token)


def _traceparent_header(span) -> tuple[bytes, bytes]:
    context = span.get_span_context()
    value = format_traceparent(context.trace_id, context.span_id, int(context.trace_flags))
    return b"traceparent", value.encode("ascii")


def current() -> RequestSpan | None:
    return _current.get()


def _open() -> RequestSpan | None:
    """The current request's span while it is still open."""
    traced = _current.get()
    return traced if traced is not None and not traced.ended else None


@contextmanager
def phase(name: str):
    """A child span of the current request's for the block (render, tokenize, submit)."""
    traced = _open()
    if traced is None:
        yield
        return
    span = traced.child(name)
    try:
        yield
    except BaseException as exc:
        span.record_exception(exc)
        raise
    finally:
        span.end()


def engine_context() -> TraceContext | None:
    """The context engine requests carry: the current request's span as their parent."""
    traced = _current.get()
    if traced is None:
        return None
    context = traced.span.get_span_context()
    return TraceContext(
        format_traceparent(context.trace_id, context.span_id, int(context.trace_flags)),
        context.trace_state.to_header() if context.trace_state else "")


def note_job(job, endpoint: str, request) -> None:
    """The GenAI request attributes of a job (a chat or completions request, or one the
    Responses and Messages faces translated)."""
    traced = _open()
    if traced is None:
        return
    first = job.candidates[0].params
    traced.span.set_attributes({
        "gen_ai.operation.name": OPERATIONS.get(endpoint, endpoint),
        "gen_ai.request.model": getattr(request, "model", None) or job.model,
        "gen_ai.response.model": job.model,
        "gen_ai.request.id": job.request_id,
        "gen_ai.response.id": job.request_id,
        "gen_ai.request.max_tokens": first.max_tokens,
        "gen_ai.request.temperature": first.temperature,
        "gen_ai.request.top_p": first.top_p,
        "gen_ai.request.n": job.plan.n,
        "gen_ai.usage.input_tokens": job.num_prompt_tokens,
        "sluice.request.stream": bool(getattr(request, "stream", False)),
    })


def note_embeddings(request_id: str, model: str, input_tokens: int, inputs: int) -> None:
    traced = _open()
    if traced is not None:
        traced.span.set_attributes({
            "gen_ai.operation.name": "embeddings", "gen_ai.request.model": model,
            "gen_ai.request.id": request_id, "gen_ai.response.id": request_id,
            "gen_ai.usage.input_tokens": input_tokens, "sluice.embeddings.inputs": inputs})


def note_frame(traced: RequestSpan | None, number: int, frame: TextFrame) -> None:
    if traced is not None:
        traced.frame(number, frame)


@contextmanager
def batch_line_span(sink: Tracing | None, path: str):
    """A batch line's own trace (it runs long after the request that created its batch),
    so its engine and postproc spans have a root."""
    if sink is None:
        yield
        return
    with request_span(sink, f"batch line POST {path}", None,
                      {"http.route": path, "sluice.batch.line": True}) as traced:
        status = [500]
        try:
            yield status
        finally:
            traced.close(status[0], None)
