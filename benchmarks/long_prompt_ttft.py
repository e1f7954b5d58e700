"""Short chats behind a long prompt (issue 15, item 5): their time to first token.

Sends one completion whose prompt is `--long-tokens` token ids (8,191 by default: the
default model's 8,192-token context minus the one token it generates), then, `--delay`
seconds later, `--chats` streamed 4-token chats at once, and prints each chat's TTFT and
the long request's total time.

    .venv/bin/python benchmarks/long_prompt_ttft.py                  # starts `sluice serve`
    .venv/bin/python benchmarks/long_prompt_ttft.py --base-url http://127.0.0.1:8000 \\
        --model SmolLM2-135M-Instruct                                # against a running server
    .venv/bin/python benchmarks/long_prompt_ttft.py -- --long-prefill-token-threshold 0
                                                     # (extra `serve` flags after --)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.servers import Stack  # noqa: E402

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def _long_request(base_url: str, model: str, n: int, run: int, out: dict) -> None:
    # Token ids well inside the vocabulary, different in every run so no prefix cache helps.
    prompt = [1000 + (i * 7919 + run * 104729) % 40000 for i in range(n)]
    started = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    out["long"] = (r.status_code, time.perf_counter() - started)


def _chat(base_url: str, model: str, run: int, out: dict, key: int) -> None:
    started = time.perf_counter()
    ttft = None
    # Four words, different in every run (the prefix cache would hide their prefill).
    content = f"Say hi, {run * 10 + key}."
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                      timeout=600) as r:
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                # The first text, or the end when the answer has none.
                if choices and (choices[0]["delta"].get("content")
                                or choices[0].get("finish_reason")):
                    ttft = time.perf_counter() - started
    out[key] = (r.status_code, ttft, time.perf_counter() - started)


def measure(base_url: str, model: str, long_tokens: int, chats: int, delay: float,
            run: int) -> dict:
    out: dict = {}
    long_thread = threading.Thread(target=_long_request,
                                   args=(base_url, model, long_tokens, run, out))
    long_thread.start()
    time.sleep(delay)
    threads = [threading.Thread(target=_chat, args=(base_url, model, run, out, i))
               for i in range(chats)]
    for t in threads:
        t.start()
    for t in [*threads, long_thread]:
        t.join()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server; default: start one")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--long-tokens", type=int, default=8191)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--delay", type=float, default=0.5)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("serve_args", nargs="*", help="extra `sluice serve` flags (after --)")
    args = p.parse_args()
    stack = None
    if args.base_url is None:
        stack = Stack(tempfile.mkdtemp(prefix="long-ttft-"), *args.serve_args)
        base_url = stack.base_url
    else:
        base_url = args.base_url
    try:
        # One short warm-up so the first run does not pay for lazy initialisation.
        measure(base_url, args.model, 64, 1, 0.0, run=-1)
        for run in range(args.runs):
            out = measure(base_url, args.model, args.long_tokens, args.chats, args.delay, run)
            ttfts = [out[i][1] for i in range(args.chats)]
            statuses = {out[i][0] for i in range(args.chats)} | {out["long"][0]}
            print(f"run {run + 1}: chat TTFT s: " + " ".join(f"{t:.2f}" for t in ttfts)
                  + f" (median {statistics.median(ttfts):.2f}, max {max(ttfts):.2f}); "
                  f"long prompt {out['long'][1]:.1f} s; statuses {sorted(statuses)}",
                  flush=True)
    finally:
        if stack is not None:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
