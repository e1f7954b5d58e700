"""What tracing and KV-cache events cost (issue 50): output tokens per second at concurrency
16 with them on vs off, side by side in one run (goal: the "on" side within 2% of "off").

Starts two stacks at once, each an engine (`sluice engine`), `--postproc-workers` postproc
workers and a frontend, all separate processes over tcp: "off" with the flags given to both
(`--engine-args`, `--frontend-args`), "on" with `--on-engine-args` / `--on-frontend-args`
added. By default "on" is KV events on a ZeroMQ PUB socket (vLLM's `--kv-events-config`,
nobody subscribed: the engine encodes and sends every batch all the same) and OpenTelemetry
traces exported over OTLP/HTTP (`--otlp-traces-endpoint`, and the standard OTEL_* variables
for every process of the side) to a throwaway sink this script runs, which answers 200 and
counts what it gets. In the on-args, FREE_PORT is a fresh loopback port each time it
appears and OTLP_SINK the sink's URL. Only one side is under load at a time: rounds
alternate the order (off, on, on, off, ...), each a `sluice bench` run (sluice.bench's
client: streaming chats, the mixed prompts, ignore_eos). Reported: each side's median and
best tok/s, the ratio on/off, and what the sink received.

    .venv/bin/python benchmarks/observability_cost.py [--rounds 3] [--num-requests 64]
        [--max-tokens 64] [--engine-args '--device cuda'] [--on-engine-args '']
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import signal
import statistics
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shared.transport import free_tcp_port  # noqa: E402
from sluice.bench.chat import BUILTIN_PROMPTS, BenchConfig, bench  # noqa: E402
from tests.servers import Proc, wait_healthy  # noqa: E402

KV_EVENTS = ('--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", '
             '"endpoint": "tcp://127.0.0.1:FREE_PORT"}\'')
TRACES = "--otlp-traces-endpoint OTLP_SINK"


class OtlpSink:
    """An OTLP/HTTP receiver that accepts every export (200, empty body) and counts them."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                size = int(self.headers.get("Content-Length") or 0)
                sink.bytes += len(self.rfile.read(size))
                sink.exports += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass  # quiet

        self.server = ThreadingHTTPServer(("127.0.0.1", free_tcp_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def expand(args: str, sink: OtlpSink) -> list[str]:
    """An args string as argv: FREE_PORT a fresh port each time, OTLP_SINK the sink."""
    args = re.sub("FREE_PORT", lambda _: str(free_tcp_port()), args)
    return shlex.split(args.replace("OTLP_SINK", sink.url))


@contextlib.contextmanager
def environment(extra: dict[str, str]):
    """os.environ with `extra` while the processes of a side start (Proc copies it)."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Side:
    """One stack: an engine, its postproc workers and a frontend, each its own process."""

    def __init__(self, name: str, tmp: str, workers: int, engine_args: list[str],
                 frontend_args: list[str]) -> None:
        self.name = name
        engine = f"tcp://127.0.0.1:{free_tcp_port()}"
        postproc = f"tcp://127.0.0.1:{free_tcp_port()}"
        port = free_tcp_port()
        self.url = f"http://127.0.0.1:{port}"
        log = os.path.join(tmp, f"{name}-%s.log")
        pp = ["--postproc-address", postproc] if workers else []
        self.procs = [Proc(["engine", "--engine-address", engine, *pp, *engine_args],
                           log % "engine")]
        self.procs += [Proc(["postproc", "--engine-postproc-address", postproc],
                            log % f"postproc{i}") for i in range(workers)]
        self.procs.append(Proc(["frontend", "--engine-address", engine, "--port", str(port),
                                *frontend_args], log % "frontend"))

    def wait(self) -> None:
        wait_healthy(self.url, self.procs)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def one_run(side: Side, args) -> float:
    config = BenchConfig(
        base_url=f"{side.url}/v1", model=None, concurrency=args.concurrency,
        num_requests=args.num_requests, max_tokens=args.max_tokens, temperature=0.0,
        ignore_eos=True, api_key=None, fresh_connections=False, warmup=args.concurrency,
        prompts=list(BUILTIN_PROMPTS["mixed"]))
    result = asyncio.run(bench(config))
    if result.errors:
        raise SystemExit(f"{side.name}: {result.errors} requests failed: {result.error_samples}")
    return result.output_tokens_per_s


def start_sides(args, tmp: str, sink: OtlpSink) -> dict[str, Side]:
    engine, frontend = shlex.split(args.engine_args), shlex.split(args.frontend_args)
    otel = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink.url}
    sides = {"off": Side("off", tmp, args.postproc_workers, engine, frontend)}
    with environment(otel if args.on_env else {}):
        sides["on"] = Side("on", tmp, args.postproc_workers,
                           [*engine, *expand(args.on_engine_args, sink)],
                           [*frontend, *expand(args.on_frontend_args, sink)])
    return sides


def report(args, rates: dict[str, list[float]], sink: OtlpSink) -> None:
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"concurrency {args.concurrency}, {args.num_requests} requests of {args.max_tokens} "
          f"tokens, {args.rounds} rounds, {args.postproc_workers} postproc workers")
    print(f"on: engine {args.on_engine_args!r}, frontend {args.on_frontend_args!r}")
    print("| side | tok/s (median) | tok/s (best) |")
    print("|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {max(values):.1f} |")
    ratio = on / off
    print(f"ratio on/off (median): {ratio:.3f} ({'within' if ratio >= 0.98 else 'outside'} "
          f"the 2% goal)")
    print(f"OTLP sink: {sink.exports} exports, {sink.bytes} bytes")
    print("per round:", {k: [round(v, 1) for v in vs] for k, vs in rates.items()})


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64, help="timed requests per run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--postproc-workers", type=int, default=1)
    p.add_argument("--engine-args", default="", help="`sluice engine` flags of both sides")
    p.add_argument("--frontend-args", default="", help="`sluice frontend` flags of both sides")
    p.add_argument("--on-engine-args", default=KV_EVENTS,
                   help="the engine's further flags on the 'on' side (default: %(default)s)")
    p.add_argument("--on-frontend-args", default=TRACES,
                   help="the frontend's further flags on the 'on' side (default: %(default)s)")
    p.add_argument("--no-on-env", dest="on_env", action="store_false",
                   help="do not set OTEL_EXPORTER_OTLP_TRACES_* (the sink, over HTTP) for "
                        "the 'on' side's processes")
    return p.parse_args()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(f"{signal.Signals(signum).name}: stopping the stacks")


def main() -> None:
    args = parse_args()
    # The stacks run in sessions of their own: a stopped run must still stop them.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sink = OtlpSink()
    with tempfile.TemporaryDirectory() as tmp:
        sides = start_sides(args, tmp, sink)
        try:
            for side in sides.values():
                side.wait()
            rates: dict[str, list[float]] = {name: [] for name in sides}
            for r in range(args.rounds):
                for name in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
                    rates[name].append(one_run(sides[name], args))
        finally:
            for side in sides.values():
                side.stop()
    sink.close()
    report(args, rates, sink)


if __name__ == "__main__":
    main()
