"""Prefix routing vs round-robin over two engines (issue 18 item 8), and the routing cost.

Starts two engines (`sluice engine`, over tcp) and one frontend per policy, both connected
to both engines. Then, for each policy in turn (engines restarted between, so both start
cold), runs the same shared-prefix workload: `--conversations` chats, each with its own
system prompt of about 150 tokens (or one for all, `--shared-system`), `--turns` turns
each, every turn re-sending the whole history (the previous answers included),
`--concurrency` chats at a time. Reports per policy
the engines' prefix-cache hit rate (prompt tokens found cached / looked up, summed over both
engines) and the TTFT of every turn after the first (mean, p50, p90), side by side.

Then times the frontend's placement for one request (`prefix_key` + `Placement.choose`
over 4 engines) against tokenizing the same prompt, in-process.

    .venv/bin/python benchmarks/prefix_routing.py
    .venv/bin/python benchmarks/prefix_routing.py --conversations 16 --turns 6 -- --threads 2
                                                     # (extra `engine` flags after --)
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

from shared.transport import free_tcp_port  # noqa: E402
from tests.engine_client import engine_stats  # noqa: E402
from tests.servers import Proc, wait_healthy, wait_until  # noqa: E402

TOPICS = ["shipping", "banking", "gardening", "astronomy", "cooking", "chess", "sailing",
          "music", "medicine", "law", "football", "geology", "poetry", "trains", "coffee",
          "painting"]


SHARED = False  # --shared-system: every chat has the same system prompt


def system_prompt(i: int) -> str:
    if SHARED:
        i = 0
    topic = TOPICS[i % len(TOPICS)]
    rules = " ".join(f"Rule {k}: when asked about {topic} topic {k}, answer plainly, cite no "
                     f"sources, keep it under three sentences, and stay polite." for k in
                     range(6))
    return f"You are assistant number {i}, an expert on {topic}. {rules}"


def conversation(url: str, i: int, turns: int, max_tokens: int, ttfts: list) -> None:
    messages = [{"role": "system", "content": system_prompt(i)}]
    for turn in range(turns):
        # With one system prompt for all, the chats must still differ: each asks its own.
        asker = f" I am customer {i}." if SHARED else ""
        messages.append({"role": "user", "content": f"Question {turn}:{asker} tell me more."})
        started = time.perf_counter()
        first, text = None, []
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                          timeout=600) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:])["choices"]
                if choices and (choices[0]["delta"].get("content") or
                                choices[0].get("finish_reason")):
                    first = first or time.perf_counter() - started
                    text.append(choices[0]["delta"].get("content") or "")
        if turn > 0:
            ttfts.append(first)
        messages.append({"role": "assistant", "content": "".join(text)})


def run_policy(tmp: str, policy: str, args, engine_extra: list[str]) -> dict:
    addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    engines = [Proc(["engine", "--engine-address", a, "--engine-id", f"engine-{i}",
                     *engine_extra], os.path.join(tmp, f"{policy}-engine{i}.log"))
               for i, a in enumerate(addresses)]
    port = free_tcp_port()
    url = f"http://127.0.0.1:{port}"
    frontend = Proc(["frontend", "--port", str(port), "--routing", policy,
                     *(x for a in addresses for x in ("--engine-address", a))],
                    os.path.join(tmp, f"{policy}-frontend.log"))
    try:
        wait_healthy(url, [*engines, frontend])
        wait_until(lambda: httpx.get(f"{url}/metrics").text.count(
            "sluice:engine_live{") >= 2 and all(
            engine_stats(a) for a in addresses), 120, "both engines")
        time.sleep(2)  # both heartbeats in
        before = [engine_stats(a) for a in addresses]
        ttfts: list[float] = []
        pending = list(range(args.conversations))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    i = pending.pop(0)
                conversation(url, i, args.turns, args.max_tokens, ttfts)

        started = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        after = [engine_stats(a) for a in addresses]
    finally:
        frontend.stop()
        for e in engines:
            e.stop()
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries
                  for a, b in zip(after, before, strict=True))
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits
               for a, b in zip(after, before, strict=True))
    ttfts.sort()
    return {
        "policy": policy, "hit_rate": hits / queries if queries else 0.0,
        "ttft_mean": statistics.mean(ttfts), "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p90": ttfts[int(len(ttfts) * 0.9)], "requests": args.conversations * args.turns,
        "elapsed": elapsed,
        "per_engine": [a.num_finished - b.num_finished for a, b in zip(after, before,
                                                                       strict=True)],
    }


def routing_overhead() -> dict:
    from frontend.engine_client.placement import Candidate, Placement, prefix_key
    from shared.protocol import pack_ids
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("default")
    text = system_prompt(3) + " Question 3: tell me more. " * 20
    n = 2000
    started = time.perf_counter()
    for _ in range(200):
        ids = tokenizer.encode(text)
    tokenize_us = (time.perf_counter() - started) / 200 * 1e6
    packed = pack_ids(ids)
    placement = Placement("prefix")
    candidates = [Candidate(name=f"engine-{i}", load=i * 3, kv_use=0.3, waiting=1)
                  for i in range(4)]
    started = time.perf_counter()
    for _ in range(n):
        placement.choose(prefix_key(packed, "salt", 16), candidates)
    route_us = (time.perf_counter() - started) / n * 1e6
    return {"prompt_tokens": len(ids), "tokenize_us": tokenize_us, "route_us": route_us}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policies", default="prefix,round-robin")
    p.add_argument("--shared-system", action="store_true",
                   help="every chat begins with the same system prompt (one affinity key)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    global SHARED
    SHARED = args.shared_system
    overhead = routing_overhead()
    print(f"routing over 4 engines: {overhead['route_us']:.1f} us per request; tokenizing "
          f"the same {overhead['prompt_tokens']}-token prompt: {overhead['tokenize_us']:.0f} us")
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_policy(tmp, policy, args, extra) for policy in args.policies.split(",")]
    print(f"{args.conversations} conversations x {args.turns} turns, concurrency "
          f"{args.concurrency}, {args.max_tokens} tokens a turn, 2 engines"
          f"{', one system prompt for all' if SHARED else ''}")
    print("| routing | prefix-cache hit rate | TTFT mean | p50 | p90 | requests per engine "
          "| wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['ttft_mean'] * 1000:.0f} ms | "
              f"{r['ttft_p50'] * 1000:.0f} ms | {r['ttft_p90'] * 1000:.0f} ms | "
              f"{' / '.join(map(str, r['per_engine']))} | {r['elapsed']:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
