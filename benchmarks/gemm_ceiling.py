"""The machine's matrix-multiply ceiling, to put serving throughput in proportion.

Times torch matmuls of the shapes a decode step of the default model multiplies (K = 576 or
1536, N up to 49152) at several batch sizes, in float32 and bfloat16, and prints the best
GFLOP/s of each dtype. `--tokens-per-s X` also prints the ratio of the model FLOPs that X
generated tokens per second imply (2 x parameters per token) to that ceiling.

    .venv/bin/python benchmarks/gemm_ceiling.py --tokens-per-s 250
"""

from __future__ import annotations

import argparse
import time

import torch

# (K, N) of each matmul in one layer of SmolLM2-135M, plus the LM head.
SHAPES = [(576, 576 + 2 * 192), (576, 576), (576, 2 * 1536), (1536, 576), (576, 49152)]
PARAMS = 134_515_008  # SmolLM2-135M, embeddings tied (the LM head counts once)


def gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.5) -> float:
    a = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.nn.functional.linear(a, w)
        runs += 1
    elapsed = time.perf_counter() - start
    return 2 * m * k * n * runs / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tokens-per-s", type=float, default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype in (torch.float32, torch.bfloat16):
        best = 0.0
        for m in args.batch:
            row = [gflops(m, k, n, dtype) for k, n in SHAPES]
            best = max(best, *row)
            print(f"{str(dtype):15} M={m:4d} " + " ".join(f"{g:7.1f}" for g in row))
        line = f"{str(dtype):15} ceiling {best:.1f} GFLOP/s"
        if args.tokens_per_s:
            used = 2 * PARAMS * args.tokens_per_s / 1e9
            line += f"; {args.tokens_per_s:g} tok/s uses {used:.1f} GFLOP/s = {used / best:.1%}"
        print(line)


if __name__ == "__main__":
    main()
