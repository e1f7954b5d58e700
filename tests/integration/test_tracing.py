"""OpenTelemetry traces across the three tiers (issue 50), against real OTLP receivers in the
test process: `sluice serve` with a postproc worker exporting over HTTP/protobuf puts one
request's frontend, engine and postproc spans in the client's trace; a frontend exporting
over gRPC to a receiver that then hangs, then refuses, answers every request all the same
and counts the spans it had to drop."""

from __future__ import annotations

import httpx
import pytest

from shared.trace_context import parse_traceparent
from tests.otlp_receiver import GrpcReceiver, HttpReceiver, ReceivedSpan
from tests.servers import Stack, metrics, wait_until

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
SERVICES = {"sluice-frontend", "sluice-engine", "sluice-postproc"}
CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
        "temperature": 0.5, "top_p": 0.9}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """`sluice serve` with one postproc worker, every process exporting to one receiver."""
    receiver = HttpReceiver()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: spans leave at once
        env.delenv("OTEL_SERVICE_NAME", raising=False)
        try:
            stack = Stack(str(tmp_path_factory.mktemp("traced")), "--postproc-workers", "1",
                          "--otlp-traces-endpoint", receiver.url,
                          "--collect-detailed-traces", "all", "--dtype", "float32",
                          "--threads", "1")
        except Exception:
            receiver.stop()
            raise
    wait_until(lambda: metrics(stack.base_url).get("sluice:postproc_workers") == 1, 60,
               "the postproc worker")
    yield stack, receiver
    stack.stop()
    receiver.stop()


def _trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def _server_span(spans: list[ReceivedSpan], service: str) -> ReceivedSpan:
    return next(s for s in spans if s.service == service and s.kind in (2, 5))  # server, consumer


def test_one_trace_across_the_three_tiers(traced):
    stack, receiver = traced
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=CHAT, timeout=120,
                   headers={"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE"})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    named = parse_traceparent(r.headers["traceparent"])
    assert named is not None and f"{named.trace_id:032x}" == CLIENT_TRACE
    # Each tier's own span ends last in its process, so it may come in a later export than
    # its children: wait for all three of those, not for any span of each tier.
    spans = _trace(receiver.wait_for(
        lambda got: SERVICES <= {s.service for s in _trace(got, CLIENT_TRACE)
                                 if s.kind in (2, 5)}), CLIENT_TRACE)
    frontend = _server_span(spans, "sluice-frontend")
    engine = _server_span(spans, "sluice-engine")
    postproc = _server_span(spans, "sluice-postproc")
    # The client's span is the frontend's parent; the frontend's is the others'.
    assert frontend.parent_span_id == CLIENT_SPAN
    assert f"{named.span_id:016x}" == frontend.span_id
    assert engine.parent_span_id == frontend.span_id == postproc.parent_span_id
    assert frontend.name == "POST /v1/chat/completions"
    assert {"render", "tokenize", "submit"} <= {s.name for s in spans
                                                if s.parent_span_id == frontend.span_id}
    assert engine.name == "llm_request" and postproc.name == "postproc"
    for span in (frontend, engine, postproc):
        assert span.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert span.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert span.attributes["gen_ai.response.finish_reasons"] == [
            r.json()["choices"][0]["finish_reason"]]
    for span in (frontend, engine):
        assert span.attributes["gen_ai.request.max_tokens"] == 6
        assert span.attributes["gen_ai.request.temperature"] == 0.5
        assert span.attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert span.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert frontend.attributes["gen_ai.response.id"] == r.json()["id"]
    assert frontend.attributes["gen_ai.request.model"] == r.json()["model"]
    assert frontend.attributes["http.response.status_code"] == 200
    assert engine.attributes["sluice.prefill.chunks"] >= 1
    assert engine.attributes["gen_ai.latency.time_in_queue"] >= 0
    assert {"scheduled", "first_token", "finished"} <= set(engine.events)
    assert postproc.attributes["sluice.postproc.frames"] >= 1
    assert engine.resource["sluice.tier"] == "engine"


def test_every_face_is_traced_and_a_new_trace_without_traceparent(traced):
    stack, receiver = traced
    model = httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"]
    faces = [
        ("/v1/completions", {"prompt": "Once", "max_tokens": 3}),
        ("/v1/chat/completions", {**CHAT, "stream": True}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
        ("/v1/messages", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                          "max_tokens": 3}),
        ("/v1/batches", {"input_file_id": "file-none", "endpoint": "/v1/completions",
                         "completion_window": "24h"}),
    ]
    traces = {}
    for path, body in faces:
        r = httpx.post(f"{stack.base_url}{path}", json=body, timeout=120,
                       headers={"traceparent": "00-zz-not-a-traceparent-01"})
        assert r.status_code in (200, 404), r.text  # the batch's file does not exist
        named = parse_traceparent(r.headers["traceparent"])
        assert named is not None and f"{named.trace_id:032x}" != CLIENT_TRACE
        traces[path] = (f"{named.trace_id:032x}", r.status_code)
    spans = receiver.wait_for(lambda got: all(
        {"sluice-frontend"} <= {s.service for s in _trace(got, t)} for t, _ in traces.values()))
    for path, (trace_id, status) in traces.items():
        frontend = _server_span(_trace(spans, trace_id), "sluice-frontend")
        assert frontend.parent_span_id == ""  # a malformed traceparent starts a new trace
        assert frontend.attributes["http.response.status_code"] == status
        assert frontend.name.endswith(path)
        if status == 200:
            wait_until(lambda t=trace_id: "sluice-engine" in {
                s.service for s in _trace(receiver.spans, t)}, 30, f"{path}'s engine span")


@pytest.fixture(scope="module")
def unreachable(shared_engine, tmp_path_factory):
    """A frontend over the session's engine (which traces nothing) exporting over gRPC with
    a queue of 8 spans and exports that give up after 2 s."""
    receiver = GrpcReceiver()
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
                            "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_BSP_MAX_QUEUE_SIZE": "8",
                            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "8",
                            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2",
                            "OTEL_SERVICE_NAME": "my-gateway"}.items():
            env.setenv(name, value)
        try:
            frontend = shared_engine.frontend(str(tmp_path_factory.mktemp("grpc")), "grpc")
        except Exception:
            receiver.stop()
            raise
    yield frontend, receiver
    frontend.stop()
    receiver.stop()


def _ask(base_url: str, traceparent: str = TRACEPARENT) -> str:
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                   headers={"traceparent": traceparent}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert traceparent.split("-")[1] in r.headers["traceparent"]
    return r.headers["traceparent"]


def test_grpc_then_a_collector_that_hangs_or_refuses_costs_no_request(unreachable):
    frontend, receiver = unreachable
    unsampled = "00-1bf7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    assert _ask(frontend.base_url, unsampled).endswith("-00")  # the client said: no trace
    _ask(frontend.base_url)
    spans = receiver.wait_for(lambda got: any(s.kind == 2 for s in _trace(got, CLIENT_TRACE)))
    server = _server_span(_trace(spans, CLIENT_TRACE), "my-gateway")  # OTEL_SERVICE_NAME wins
    assert not [s for s in spans if s.name.endswith("/health")]  # probes are not traced
    assert not _trace(spans, unsampled.split("-")[1])
    assert server.parent_span_id == CLIENT_SPAN
    assert server.attributes["gen_ai.operation.name"] == "text_completion"
    receiver.hang.set()  # takes the next export and never answers
    for _ in range(4):  # 4+ spans each: more than the queue holds while the export hangs
        _ask(frontend.base_url)
    wait_until(lambda: metrics(frontend.base_url).get("sluice:trace_spans_dropped_total", 0)
               > 0, 30, "the dropped spans counted")
    receiver.stop()  # the port closes: connections are refused
    for _ in range(2):
        _ask(frontend.base_url)
