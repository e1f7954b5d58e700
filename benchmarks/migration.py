"""What a migration costs a stream (issue 39): the pause a client sees when its engine dies
mid-stream and the stream goes on on another engine (detection + the re-prefill of prompt +
tokens so far), side by side with the streams of the same run that were not moved.

Starts two engines (`--batch-invariant`, one thread each) and a frontend on both
(round-robin), streams `--streams` greedy completions of `--max-tokens` tokens, SIGKILLs
one engine once every stream has `--kill-after` tokens, and prints, for moved and unmoved
streams: total time, the longest gap between two chunks, and the median gap. It also checks
each text against a fault-free run of the same prompts (token for token under
`--batch-invariant`).

    .venv/bin/python benchmarks/migration.py
    .venv/bin/python benchmarks/migration.py --streams 8 --max-tokens 256 --kill-after 64
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from shared.transport import free_tcp_port  # noqa: E402
from tests.servers import Proc, start_frontend, wait_healthy, wait_until  # noqa: E402


class Stream(threading.Thread):
    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {"prompt": prompt, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True, "stream": True}
        self.times: list[float] = []
        self.text, self.id = "", ""

    def run(self) -> None:
        start = time.monotonic()
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body,
                          timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    self.id = chunk.get("id", self.id)
                    self.text += "".join(c.get("text", "") for c in chunk.get("choices", []))
                    self.times.append(time.monotonic() - start)

    def stats(self) -> tuple[float, float, float]:
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)] or [0.0]
        return self.times[-1], max(gaps), statistics.median(gaps)


def run_streams(url: str, prompts: list[str], max_tokens: int, on_started=None) -> list[Stream]:
    streams = [Stream(url, p, max_tokens) for p in prompts]
    for s in streams:
        s.start()
    if on_started is not None:
        on_started(streams)
    for s in streams:
        s.join()
    return streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kill-after", type=int, default=32, help="tokens each stream has first")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="sluice-migration-")
    addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    engines = [Proc(["engine", "--engine-address", a, "--engine-id", f"engine-{i}",
                     "--threads", "1", "--batch-invariant"], os.path.join(tmp, f"e{i}.log"))
               for i, a in enumerate(addresses)]
    frontend, url = start_frontend(tmp, addresses[0], "frontend", "--engine-address",
                                   addresses[1], "--routing", "round-robin")
    try:
        wait_healthy(url, [*engines, frontend])
        time.sleep(3)  # both engines live
        prompts = [f"Tell the story of town number {i}:" for i in range(args.streams)]
        reference = run_streams(url, prompts, args.max_tokens)

        def kill(streams: list[Stream]) -> None:
            wait_until(lambda: all(len(s.times) > args.kill_after for s in streams), 600,
                       "streams under way")
            engines[0].popen.kill()

        faulted = run_streams(url, prompts, args.max_tokens, kill)
        moved = set(re.findall(r"request (\S+) \(\S+\) moved to engine", frontend.log()))
        rows = {"unfaulted run": reference,
                "faulted run, moved": [s for s in faulted if s.id in moved],
                "faulted run, not moved": [s for s in faulted if s.id not in moved]}
        print(f"{args.streams} streams of {args.max_tokens} tokens; engine-0 killed after "
              f"{args.kill_after} tokens of each")
        print(f"{'':24} {'streams':>7} {'total s':>8} {'max gap s':>10} {'median gap s':>13}")
        for name, streams in rows.items():
            if not streams:
                continue
            per_stream = [s.stats() for s in streams]
            total, worst, median = (statistics.mean(column)
                                    for column in zip(*per_stream, strict=True))
            print(f"{name:24} {len(streams):7} {total:8.2f} {worst:10.3f} {median:13.4f}")
        same = sum(a.text == b.text for a, b in zip(reference, faulted, strict=True))
        print(f"texts equal to the unfaulted run: {same} of {args.streams}")
    finally:
        for p in [frontend, *engines]:
            p.stop()


if __name__ == "__main__":
    main()
