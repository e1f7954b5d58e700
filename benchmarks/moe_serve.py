"""Grouped experts vs a per-token loop through a server (issue 32): `sluice serve` on a tiny
random Qwen3-MoE, measured with `sluice bench`, once as served and once with
SLUICE_MOE_PER_TOKEN=1 (engine.models.moe: every token's k experts one by one, the naive
way, a reference for this benchmark only), at several concurrency levels, the two servers
measured in turns.

No MoE checkpoint is at hand offline, so the model is built here: random weights (speed
does not depend on their values), Qwen3-MoE's layout scaled down (hidden 256, 4 layers,
32 experts of width 128, top-4, q/k norms), with the tests' small byte-level tokenizer.
Answers are --max-tokens long (--ignore-eos), greedy, float32.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_serve.py [--concurrency 1 16]
        [--max-tokens 32] [--rounds 2] [--threads N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers

from shared.transport import free_tcp_port
from tests.servers import Proc, wait_healthy
from tests.tiny_vlm import tiny_vlm_tokenizer


def build_model(path: str) -> None:
    tokenizer = tiny_vlm_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
        norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)


def bench(base_url: str, concurrency: int, max_tokens: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "--base-url", f"{base_url}/v1",
         "--concurrency", str(concurrency), "--num-requests", str(max(4, 2 * concurrency)),
         "--max-tokens", str(max_tokens), "--ignore-eos", "--warmup", "1", "--json"],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def start_server(path: str, per_token: bool, args, log_dir: str) -> tuple[Proc, str]:
    port = free_tcp_port()
    threads = ["--threads", str(args.threads)] if args.threads else []
    env_before = os.environ.get("SLUICE_MOE_PER_TOKEN")
    os.environ["SLUICE_MOE_PER_TOKEN"] = "1" if per_token else "0"  # Proc copies os.environ
    try:
        server = Proc(["serve", path, "--port", str(port), "--device", "cpu",
                       "--dtype", "float32", *threads],
                      os.path.join(log_dir, f"serve-{int(per_token)}.log"))
    finally:
        if env_before is None:
            del os.environ["SLUICE_MOE_PER_TOKEN"]
        else:
            os.environ["SLUICE_MOE_PER_TOKEN"] = env_before
    return server, f"http://127.0.0.1:{port}"


def mean(results: list[dict], key: str) -> float:
    return sum(r[key] for r in results) / len(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="turns per side, averaged")
    p.add_argument("--threads", type=int, default=None, help="the engine's torch threads")
    p.add_argument("--keep", help="build the model in this folder and keep it")
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    path = args.keep or os.path.join(tmp.name, "qwen3-moe-tiny")
    if not os.path.isfile(os.path.join(path, "config.json")):
        os.makedirs(path, exist_ok=True)
        build_model(path)
    # Both servers up at once (an idle one costs next to nothing), measured in turns, so a
    # change in the machine's load during the run falls on both sides alike.
    servers = [start_server(path, per_token, args, tmp.name) for per_token in (False, True)]
    try:
        for server, base_url in servers:
            wait_healthy(base_url, [server])
        runs = {c: ([], []) for c in args.concurrency}
        for _ in range(args.rounds):
            for c in args.concurrency:
                for side, (_, base_url) in zip(runs[c], servers, strict=True):
                    side.append(bench(base_url, c, args.max_tokens))
    finally:
        for server, _ in servers:
            server.stop()
    print("| concurrency | grouped tok/s | per-token loop tok/s | grouped / loop | "
          "ITL p50 grouped / loop (ms) | errors |")
    print("|---:|---:|---:|---:|---|---:|")
    for c in args.concurrency:
        g, per = runs[c]
        rate_g, rate_l = mean(g, "output_tokens_per_s"), mean(per, "output_tokens_per_s")
        errors = sum(r["errors"] for r in g + per)
        print(f"| {c} | {rate_g:.1f} | {rate_l:.1f} | {rate_g / rate_l:.2f}x | "
              f"{mean(g, 'itl_p50_ms'):.0f} / {mean(per, 'itl_p50_ms'):.0f} | {errors} |")

if __name__ == "__main__":
    main()
