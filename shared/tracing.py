"""OpenTelemetry tracing for every tier: the exporter set-up and the span writer thread.

Tracing is on when `--otlp-traces-endpoint` is given (vLLM's flag) or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` is set (and
`OTEL_SDK_DISABLED` is not true). Only then is the SDK imported (`start_tracing`), so a
process without tracing loads none of it. The SDK reads the other `OTEL_*` variables itself
(headers, timeout, TLS, `OTEL_BSP_*`, the sampler, resource attributes); the protocol is
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or `OTEL_EXPORTER_OTLP_PROTOCOL`): `grpc` (vLLM's
default) or `http/protobuf`.

Spans leave through a BatchSpanProcessor: a bounded queue and one export thread, so a
collector that is down, slow or refusing costs no request anything; spans it cannot take
are counted in `sluice:trace_spans_dropped_total{service, reason}`. The engine and the
postproc worker never build a span on their hot loops: they hand a finished `SpanData`
(numbers stamped on the request as it ran) to `Tracing.emit`, and a thread of this module
turns it into an SDK span.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from urllib.parse import urlsplit

import msgspec

from shared.trace_context import TraceParent
from shared.tracing_flags import traces_endpoint

log = logging.getLogger("sluice.tracing")

PROTOCOLS = ("grpc", "http/protobuf")
SHUTDOWN_TIMEOUT_MS = 2000  # at exit: what the last export may take (a hung collector)
EMIT_QUEUE_SIZE = 4096  # finished SpanData waiting for the writer thread


class SpanEvent(msgspec.Struct, array_like=True, frozen=True):
    name: str
    time_s: float  # time.time()
    attributes: dict = {}


class SpanData(msgspec.Struct):
    """A span already over, as the engine and the postproc worker record it."""

    name: str
    parent: TraceParent
    start_s: float  # time.time() clock
    end_s: float
    attributes: dict
    events: list[SpanEvent] = []
    error: str | None = None  # set: the span's status is ERROR with this description
    kind: str = "internal"  # internal | server | consumer


def traces_protocol() -> str:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol not in PROTOCOLS:
        raise SystemExit(f"sluice: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: "
                         f"sluice exports traces over {' or '.join(PROTOCOLS)}")
    return protocol


def _exporter(flag: str | None, protocol: str):
    """The OTLP exporter. The flag's URL is used as given, except that an http/protobuf URL
    without a path gets the standard /v1/traces; from the environment, the SDK reads it."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        if flag and urlsplit(flag).path in ("", "/"):
            flag = flag.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=flag) if flag else OTLPSpanExporter()


class Tracing:
    """One process's tracer. `tracer` is the SDK's, for the frontend's live spans; `emit`
    takes finished spans from threads that must not wait (it never blocks)."""

    def __init__(self, provider, service: str) -> None:
        from opentelemetry import trace

        self._trace = trace
        self.provider = provider
        self.service = service
        self.tracer = provider.get_tracer("sluice")
        self._queue: queue.Queue = queue.Queue(EMIT_QUEUE_SIZE)
        threading.Thread(target=self._write_loop, name="trace-writer", daemon=True).start()

    def context(self, parent: TraceParent | None):
        """An OpenTelemetry Context whose current span is the remote `parent` (None: a root)."""
        if parent is None:
            return None
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

        state = TraceState.from_header([parent.tracestate]) if parent.tracestate else None
        span = NonRecordingSpan(SpanContext(parent.trace_id, parent.span_id, is_remote=True,
                                            trace_flags=TraceFlags(parent.flags),
                                            trace_state=state))
        return self._trace.set_span_in_context(span)

    def emit(self, data: SpanData) -> None:
        try:
            self._queue.put_nowait(data)
        except queue.Full:
            count_dropped(self.service, "queue_full")

    def _write_loop(self) -> None:
        while True:
            data = self._queue.get()
            try:
                self._write(data)
            except Exception:  # noqa: BLE001 - one bad span must not stop the rest
                log.exception("could not write span %s", data.name)

    def _write(self, data: SpanData) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        kind = {"server": SpanKind.SERVER, "consumer": SpanKind.CONSUMER}.get(
            data.kind, SpanKind.INTERNAL)
        span = self.tracer.start_span(data.name, context=self.context(data.parent), kind=kind,
                                      attributes=data.attributes, start_time=_ns(data.start_s))
        for event in data.events:
            span.add_event(event.name, event.attributes, timestamp=_ns(event.time_s))
        if data.error is not None:
            span.set_status(Status(StatusCode.ERROR, data.error))
        span.end(end_time=_ns(max(data.end_s, data.start_s)))

    def shutdown(self) -> None:
        self.provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


_active: Tracing | None = None


def tracing() -> Tracing | None:
    """This process's tracing, or None when it is off."""
    return _active


def start_tracing(service: str, flag: str | None, instance: str = "") -> Tracing | None:
    """Turns tracing on for this process when an endpoint is configured (see the module's
    doc); `service` is its default service.name (OTEL_SERVICE_NAME wins)."""
    global _active
    endpoint = traces_endpoint(flag)
    if endpoint is None:
        return None
    protocol = traces_protocol()
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider

    attributes = {"sluice.tier": service.removeprefix("sluice-")}
    if instance:
        attributes["service.instance.id"] = instance
    if "service.name" not in OTELResourceDetector().detect().attributes:
        attributes["service.name"] = service
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    provider.add_span_processor(_processor(_exporter(flag, protocol), service))
    _active = Tracing(provider, service)
    atexit.register(_shutdown, provider)
    log.info("tracing: %s spans go to %s over %s", service, endpoint, protocol)
    return _active


def _shutdown(provider) -> None:
    """At exit: the last spans get SHUTDOWN_TIMEOUT_MS to leave, not the SDK's 30 s."""
    for processor in provider._active_span_processor._span_processors:
        processor.shutdown(timeout_millis=SHUTDOWN_TIMEOUT_MS)


def _processor(exporter, service: str):
    """A BatchSpanProcessor (its bounds from OTEL_BSP_*) that counts what it drops: spans
    its full queue refuses and spans whose export failed."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

    class CountingExporter:
        def export(self, spans):
            result = exporter.export(spans)
            if result is not SpanExportResult.SUCCESS:
                count_dropped(service, "export_failed", len(spans))
            return result

        def shutdown(self, timeout_millis: float = SHUTDOWN_TIMEOUT_MS) -> None:
            try:  # the gRPC exporter takes a timeout, the HTTP one does not
                exporter.shutdown(timeout_millis=timeout_millis)
            except TypeError:
                exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return exporter.force_flush(timeout_millis)

    class CountingProcessor(BatchSpanProcessor):
        def on_end(self, span) -> None:
            batch = self._batch_processor
            if len(batch._queue) >= batch._max_queue_size:  # the SDK drops the oldest
                count_dropped(service, "queue_full")
            super().on_end(span)

    return CountingProcessor(CountingExporter())


_dropped = None


def dropped_spans_counter():
    """`sluice:trace_spans_dropped_total{service, reason}` (registered by whoever serves
    /metrics; in prometheus_client's multiprocess mode a frontend's scrape sums every
    process of `sluice serve`)."""
    global _dropped
    if _dropped is None:
        from prometheus_client import Counter

        _dropped = Counter("sluice:trace_spans_dropped",
                           "Trace spans lost before a collector took them: the export "
                           "queue was full (queue_full), or the export failed "
                           "(export_failed).", ["service", "reason"], registry=None)
    return _dropped


def count_dropped(service: str, reason: str, n: int = 1) -> None:
    dropped_spans_counter().labels(service, reason).inc(n)
