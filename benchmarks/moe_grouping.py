"""Grouped experts vs a per-token loop, on one MoE layer's MLP (engine.models.moe.MoeBlock).

The MoE block sorts a step's (token, expert) pairs by expert and runs each expert's rows
through one matmul per projection; the baseline runs every token's k experts one by one,
as a naive implementation would. Both give the same output (checked); the table is the
time per step for several step sizes (decode batches to prefill chunks).

    python benchmarks/moe_grouping.py [--hidden 1024 --inter 384 --experts 64 --top-k 8]
        [--tokens 1 8 64 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.layers.config import MoeConfig
from engine.layers.torch_ops import TorchOps
from engine.models.moe import ExpertLinear, MoeBlock


def per_token_loop(block: MoeBlock, x: torch.Tensor, ops) -> torch.Tensor:
    return block.per_token_experts(x, *block.route(x), ops)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    # One thread by default: on a shared machine, OpenMP's spinning threads make small
    # matmuls erratic, which would measure the machine's load, not the grouping.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    h, i, e = args.hidden, args.inter, args.experts

    def rand(*shape):
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    config = MoeConfig(num_experts=e, top_k=args.top_k, intermediate_size=i,
                       norm_topk_prob=True)
    block = MoeBlock(config, rand(e, h), None,
                     ExpertLinear([rand(2 * i, h) for _ in range(e)]),
                     ExpertLinear([rand(h, i) for _ in range(e)]))
    ops = TorchOps()
    print(f"hidden {h}, expert width {i}, {e} experts, top-{args.top_k}, float32, "
          f"{torch.get_num_threads()} threads")
    print("| tokens | grouped (ms) | per-token loop (ms) | ratio |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, h, generator=gen)
            torch.testing.assert_close(block(x, ops), per_token_loop(block, x, ops),
                                       atol=1e-4, rtol=1e-4)
            repeats = max(2, 64 // tokens)
            grouped = timed(lambda x=x: block(x, ops), repeats)
            loop = timed(lambda x=x: per_token_loop(block, x, ops), max(1, repeats // 4))
            print(f"| {tokens} | {grouped * 1e3:.2f} | {loop * 1e3:.2f} | "
                  f"{loop / grouped:.1f}x |")


if __name__ == "__main__":
    main()
