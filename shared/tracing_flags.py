"""The tracing flags every serving process takes (vLLM's names), and what `sluice serve`
forwards of them. Beside `shared.tracing`, which they turn on; nothing here imports the
OpenTelemetry SDK."""

from __future__ import annotations

import argparse
import os

# vLLM's --collect-detailed-traces modules. sluice records all it has whatever is chosen.
DETAILED_TRACE_MODULES = ("all", "model", "worker")


def detailed_modules(text: str) -> str:
    """An argparse type: vLLM's comma-separated modules (all, model, worker)."""
    parts = [p.strip() for p in text.split(",")]
    unknown = [p for p in parts if p not in DETAILED_TRACE_MODULES]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(
            f"{text!r}: choose from {', '.join(DETAILED_TRACE_MODULES)}, comma-separated")
    return ",".join(parts)


def add_tracing_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tracing (OpenTelemetry; docs/observability.md)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces there over OTLP (gRPC, or HTTP/protobuf "
                        "with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), as vLLM's; "
                        "default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off")
    g.add_argument("--collect-detailed-traces", type=detailed_modules, default=None,
                   metavar="MODULES",
                   help="vLLM's (all, model, worker): accepted; sluice's spans always carry "
                        "every detail it records (phase times, prefill chunks, preemptions), "
                        "which costs nothing per step")


def traces_endpoint(flag: str | None) -> str | None:
    """Where traces go, or None when tracing is off: the flag, else the OTEL_ variables."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if flag:
        return flag
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def check_tracing_flags(parser: argparse.ArgumentParser, args) -> None:
    """As vLLM: detailed traces without anywhere to send them is a mistake, said at start."""
    if (getattr(args, "collect_detailed_traces", None)
            and traces_endpoint(getattr(args, "otlp_traces_endpoint", None)) is None):
        parser.error("--collect-detailed-traces needs --otlp-traces-endpoint (or "
                     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")


def tracing_argv(args) -> list[str]:
    """The tracing flags as `sluice serve` passes them to each process it starts."""
    argv = []
    if getattr(args, "otlp_traces_endpoint", None):
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if getattr(args, "collect_detailed_traces", None):
        argv += ["--collect-detailed-traces", args.collect_detailed_traces]
    return argv
