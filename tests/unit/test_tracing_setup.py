"""Turning tracing on (shared.tracing, shared.tracing_flags): the flags and the OTEL_*
variables that decide it, the exporter each protocol gets, a process without tracing that
loads no OpenTelemetry, and a collector that hangs or fails costing a span, never a wait."""

import subprocess
import sys
import threading
import time

import pytest

from shared import tracing
from sluice.cli import _common_argv, parse_args

ENV = ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
       "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_flag_or_the_standard_variables_turn_it_on(monkeypatch):
    assert tracing.traces_endpoint(None) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://all:4317")
    assert tracing.traces_endpoint(None) == "http://all:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317")
    assert tracing.traces_endpoint(None) == "http://traces:4317"
    assert tracing.traces_endpoint("http://flag:4317") == "http://flag:4317"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "TRUE")
    assert tracing.traces_endpoint("http://flag:4317") is None


def test_the_protocol_is_the_standard_variables(monkeypatch):
    assert tracing.traces_protocol() == "grpc"  # vLLM's default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert tracing.traces_protocol() == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    assert tracing.traces_protocol() == "grpc"
    for bad in ("http/json", "GRPC", "thrift"):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", bad)
        with pytest.raises(SystemExit, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
            tracing.traces_protocol()


def test_an_http_endpoint_without_a_path_gets_v1_traces():
    assert tracing._exporter("http://c:4318", "http/protobuf")._endpoint == \
        "http://c:4318/v1/traces"
    assert tracing._exporter("http://c:4318/custom", "http/protobuf")._endpoint == \
        "http://c:4318/custom"


def test_flags_on_every_serving_command_and_forwarded_by_serve():
    for command in ("serve", "engine", "frontend", "postproc"):
        args = parse_args([command, "--otlp-traces-endpoint", "http://c:4317",
                           "--collect-detailed-traces", "model, worker"])
        assert args.otlp_traces_endpoint == "http://c:4317"
        assert args.collect_detailed_traces == "model,worker"
    argv = _common_argv(parse_args(["serve", "--otlp-traces-endpoint", "http://c:4317",
                                    "--collect-detailed-traces", "all"]))
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://c:4317"
    assert argv[argv.index("--collect-detailed-traces") + 1] == "all"
    assert "--otlp-traces-endpoint" not in _common_argv(parse_args(["serve"]))
    for bad in ("", "bogus", "all,", "model;worker"):
        with pytest.raises(SystemExit):
            parse_args(["engine", "--otlp-traces-endpoint", "http://c:4317",
                        "--collect-detailed-traces", bad])


def test_detailed_traces_need_somewhere_to_go(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_args(["frontend", "--collect-detailed-traces", "all"])
    assert "--collect-detailed-traces needs --otlp-traces-endpoint" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4317")
    assert parse_args(["frontend", "--collect-detailed-traces", "all"]).collect_detailed_traces


def test_a_process_without_tracing_loads_no_opentelemetry():
    code = ("import sys; import sluice.cli, frontend.http.app, frontend.http.server, "
            "engine.step.tracing, postproc.worker; "
            "print([m for m in sys.modules if m.startswith('opentelemetry')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


class StuckExporter:
    """An exporter whose collector never answers (until released), then fails."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.calls += 1
        self.release.wait(30)
        return SpanExportResult.FAILURE

    def shutdown(self, timeout_millis=0):
        self.release.set()

    def force_flush(self, timeout_millis=0):
        return True


def _dropped(reason: str) -> float:
    return tracing.dropped_spans_counter().labels("test", reason)._value.get()


def test_a_stuck_collector_costs_spans_not_time(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider

    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1")
    exporter = StuckExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(tracing._processor(exporter, "test"))
    tracer = provider.get_tracer("t")
    full, failed = _dropped("queue_full"), _dropped("export_failed")
    tracer.start_span("first").end()
    deadline = time.monotonic() + 30  # the export thread takes it (a loaded host is slow)
    while exporter.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(49):
        tracer.start_span(f"s{i}").end()
    # Every span ended while the first export still hangs (it would take 30 s to give up):
    # one in export, 4 queued, the other 45 dropped and counted.
    assert exporter.calls == 1 and not exporter.release.is_set()
    assert _dropped("queue_full") - full >= 40
    exporter.release.set()
    deadline = time.monotonic() + 10
    while _dropped("export_failed") == failed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dropped("export_failed") > failed
    provider.shutdown()
