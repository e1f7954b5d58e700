"""Real OTLP trace receivers for tests, in the test process: HTTP/protobuf (a small HTTP
server decoding `ExportTraceServiceRequest`) and gRPC (opentelemetry-proto's TraceService).
Each keeps the spans it got, and can be told to hang (accept and never answer)."""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as service_pb2

from shared.transport import free_tcp_port


class ReceivedSpan(msgspec.Struct):
    service: str
    name: str
    trace_id: str  # hex, as traceparent writes it
    span_id: str
    parent_span_id: str  # "" for a root
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    status: int  # 0 unset, 1 ok, 2 error
    attributes: dict
    events: list[str]
    resource: dict


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(pairs) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


def spans_of(request: service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(ReceivedSpan(
                    resource.get("service.name", ""), span.name, span.trace_id.hex(),
                    span.span_id.hex(), span.parent_span_id.hex(), span.kind,
                    span.status.code, _attributes(span.attributes),
                    [e.name for e in span.events], resource))
    return out


class Receiver:
    """What both receivers share: the spans so far, and the hang switch."""

    def __init__(self) -> None:
        self.port = free_tcp_port()
        self.spans: list[ReceivedSpan] = []
        self.exports = 0  # export calls that reached us (answered or not)
        self.hang = threading.Event()  # set: take exports and never answer
        self.released = threading.Event()  # set at stop: let hung handlers go
        self._lock = threading.Lock()

    def take(self, request: service_pb2.ExportTraceServiceRequest) -> bool:
        """Keeps its spans; False when it must hang instead of answering."""
        with self._lock:
            self.exports += 1
        if self.hang.is_set():
            self.released.wait(60)
            return False
        with self._lock:
            self.spans.extend(spans_of(request))
        return True

    def wait_for(self, condition, timeout: float = 30.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            if condition(spans):
                return spans
            time.sleep(0.1)
        raise AssertionError(f"the receiver never got the spans wanted; it has {spans}")


class HttpReceiver(Receiver):
    """OTLP/HTTP with protobuf bodies at /v1/traces."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = service_pb2.ExportTraceServiceRequest.FromString(body)
                if self.path != "/v1/traces" or not receiver.take(request):
                    return  # hung: the client waits until it gives up
                answer = service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver(Receiver):
    """OTLP/gRPC: opentelemetry-proto's TraceService on an insecure port."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as rpc

        super().__init__()
        receiver = self

        class Service(rpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's name
                if not receiver.take(request):
                    context.abort(grpc.StatusCode.UNAVAILABLE, "stopped")
                return service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        rpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Closes the port: from now on connections are refused."""
        self.released.set()
        self.server.stop(grace=0).wait(5)
