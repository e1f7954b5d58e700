"""The batch-invariant mode (issue 20): how often temperature-0 answers change under load,
and what the mode costs in throughput, side by side in one run.

Starts `sluice serve` twice on the default model in bfloat16, with and without
`--batch-invariant`. For each server: the answer of each of 8 fixed prompts alone on the
idle server, then `--clients` streaming clients sending those prompts round-robin for
`--loaded-requests` requests, counting answers that differ from the idle one. Then
`sluice bench` (mixed prompts, 128 tokens) at each `--concurrency`, the two servers taking
turns so a busy neighbour on the machine hurts both alike. Prints one table.

    .venv/bin/python benchmarks/batch_invariance.py
    .venv/bin/python benchmarks/batch_invariance.py --concurrency 1 16 64 --loaded-requests 512
    .venv/bin/python benchmarks/batch_invariance.py -- --threads 1   # extra `serve` flags
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.servers import Stack  # noqa: E402

PROMPTS = [
    "Explain how a hash map handles collisions.",
    "Write a haiku about a lighthouse in winter.",
    "What are the main differences between TCP and UDP?",
    "Summarise the plot of Romeo and Juliet.",
    "Give me a Python function that reverses a linked list.",
    "Why is the sky blue?",
    "List five tips for keeping a sourdough starter healthy.",
    "Describe the water cycle in a few sentences.",
]
MAX_TOKENS = 64


async def answer(client: httpx.AsyncClient, url: str, prompt: str) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    parts = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


async def changed_answers(url: str, clients: int, requests: int) -> tuple[int, int]:
    """(answers that differ from the idle server's, answers) under `clients` streams."""
    async with httpx.AsyncClient(timeout=600) as client:
        idle = [await answer(client, url, p) for p in PROMPTS]
        queue = list(range(requests))
        changed = 0

        async def worker() -> None:
            nonlocal changed
            while queue:
                i = queue.pop() % len(PROMPTS)
                changed += await answer(client, url, PROMPTS[i]) != idle[i]

        await asyncio.gather(*(worker() for _ in range(clients)))
    return changed, requests


def bench(url: str, concurrency: int) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "--base-url", f"{url}/v1",
         "--concurrency", str(concurrency), "--num-requests", str(max(8, 4 * concurrency)),
         "--max-tokens", "128", "--json"],
        capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["output_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--loaded-requests", type=int, default=256)
    parser.add_argument("serve_flags", nargs="*", help="extra `sluice serve` flags, after --")
    args = parser.parse_args()
    modes = {"default": [], "batch-invariant": ["--batch-invariant"]}
    print("| | default | --batch-invariant |\n|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        stacks = {}
        try:
            for name, flags in modes.items():
                os.makedirs(os.path.join(tmp, name))
                stacks[name] = Stack(os.path.join(tmp, name), "--dtype", "bfloat16", *flags,
                                     *args.serve_flags)
            changed = [asyncio.run(changed_answers(s.base_url, args.clients,
                                                   args.loaded_requests))
                       for s in stacks.values()]
            print("| answers changed under load | " + " | ".join(
                f"{n} / {total}" for n, total in changed) + " |", flush=True)
            for c in args.concurrency:
                base, inv = (bench(s.base_url, c) for s in stacks.values())
                print(f"| output tok/s, concurrency {c} | {base:.1f} | {inv:.1f} "
                      f"({inv / base:.2f}x) |", flush=True)
        finally:
            for s in stacks.values():
                s.stop()

if __name__ == "__main__":
    main()
