"""`sluice serve` on the GPU, then `sluice bench` against it at each concurrency: the whole
stack's throughput (docs/benchmarks.md compares it with the engine offline).

Readiness is polled from Python (GET /health until 200; curl may be absent on the device).
Each bench sends 2 x concurrency requests (16 at least) of 128 tokens, ignore_eos, greedy.

    python -m benchmarks.gpukit.serve_bench --model DIR --json OUT.json --server-log LOG
        [--concurrency 1 64] [--ready-timeout 60] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MAX_TOKENS = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until GET url answered 200; TimeoutError, or RuntimeError if the server
    exited first."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return time.monotonic() - start
        except OSError:  # refused, reset, 503 while the engine starts
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")


def bench(base_url: str, concurrency: int) -> dict:
    requests = max(16, 2 * concurrency)
    argv = [sys.executable, "-m", "sluice", "bench", "--base-url", base_url,
            "--concurrency", str(concurrency), "--num-requests", str(requests),
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sluice bench at concurrency {concurrency} failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", type=Path, required=True, help="where the results go")
    parser.add_argument("--server-log", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--ready-timeout", type=float, default=60.0)
    parser.add_argument("--device", default="cuda", help="cpu: to try the script here")
    args = parser.parse_args()
    port = free_port()
    largest = max(args.concurrency)
    with args.server_log.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "sluice", "serve", "--model", args.model,
             "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
             "--dtype", "bfloat16", "--max-num-seqs", str(largest),
             "--max-num-batched-tokens", "4096", "--gpu-memory-utilization", "0.5"],
            # In this process's group: a step timeout's kill of the group reaches it and the
            # engine and frontend it starts.
            stdout=log, stderr=subprocess.STDOUT)
    results: dict = {"model": args.model, "max_tokens": MAX_TOKENS, "runs": []}
    try:
        ready = wait_ready(f"http://127.0.0.1:{port}/health", server, args.ready_timeout)
        results["ready_s"] = round(ready, 1)
        print(f"server ready in {ready:.1f} s", flush=True)
        for concurrency in args.concurrency:
            run = bench(f"http://127.0.0.1:{port}/v1", concurrency)
            results["runs"].append({"concurrency": concurrency, **run})
            summary = {k: v for k, v in run.items() if "per_s" in k or "ttft" in k}
            print(f"concurrency {concurrency}: {summary}", flush=True)
    finally:
        args.json.write_text(json.dumps(results, indent=1))
        server.terminate()  # sluice serve stops its engine and frontend on SIGTERM
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
