"""The quantized linear's int16 path against its float path, one decode step's linears of the
default checkpoint (SmolLM2's 30 layers' q/k/v, o, gate/up, down in Q4_1 blocks, and the LM
head in Q8_0 blocks, each kind on its own line), at each row count: `quantized_linear` with
float32 x, with `int16_x=True` (x rounded to int16 per group of 4 values, integer dot
products), and F.linear over the dense float32 weights (what a float32 model runs past
QUANTIZED_MAX_ROWS_FLOAT32 rows).

Robust on a loaded machine: the three run interleaved, round after round, in one process,
and the table gives the median of the per-round ratios (each round's three timings are
seconds apart, so a neighbour's load hits them alike) beside each one's best time.

    .venv/bin/python benchmarks/int16_linears.py                      # avx2 build
    .venv/bin/python benchmarks/int16_linears.py --isa native --rows 1 4 16 64 --threads 1
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F

from engine.kernels.cpu_kernels import ISA_MARCH, kernels_for
from engine.layers.gguf_weights import BLOCK_KINDS
from engine.models.registry import load_model_config, load_quantized_weights, load_weights
from shared.model_source import default_model_path

KIND_NAMES = {kind: name for name, kind in BLOCK_KINDS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="avx2", choices=list(ISA_MARCH))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=["wall", "thread"], default="thread",
                        help="thread: this thread's CPU time (meaningful with --threads 1)")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(args.threads)

    module = kernels_for(args.isa)
    path = default_model_path()
    config = load_model_config(path)
    quantized = load_quantized_weights(path, config)
    dense = {name: w for name, w in load_weights(path, config, torch.float32).items()
             if name in quantized}
    packed = {name: (module.pack_blocks(q.blocks, q.kind), q.kind)
              for name, q in quantized.items()}
    gen = torch.Generator().manual_seed(0)

    print(f"build {module.simd}, {args.threads} thread(s), {args.clock} clock, "
          f"{args.rounds} interleaved rounds; ms per step's linears (best), ratios (median)")
    print("| rows | weights | float x (ms) | int16 x (ms) | F.linear fp32 (ms) "
          "| int16 speedup over float x | int16 speedup over F.linear |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    kinds = {kind: [name for name, (_, k) in packed.items() if k == kind]
             for kind in sorted({k for _, k in packed.values()})}
    for rows, (kind, names) in itertools.product(args.rows, kinds.items()):
        x = {name: torch.randn(rows, dense[name].shape[1], generator=gen) for name in names}

        def blocks(int16_x: bool, x=x, names=names):
            for name in names:
                module.quantized_linear(x[name], *packed[name], int16_x=int16_x)

        def dense_f32(x=x, names=names):
            for name in names:
                F.linear(x[name], dense[name])

        steps = [lambda: blocks(False), lambda: blocks(True), dense_f32]
        for step in steps:
            step()  # warm: first touch of the weights, the thread pool
        times: list[list[float]] = [[] for _ in steps]
        for _ in range(args.rounds):
            for i, step in enumerate(steps):
                start = clock()
                step()
                times[i].append(clock() - start)
        over_float = statistics.median(f / q for f, q in zip(times[0], times[1], strict=True))
        over_dense = statistics.median(d / q for d, q in zip(times[2], times[1], strict=True))
        best = [min(t) * 1e3 for t in times]
        label = f"{KIND_NAMES[kind]} ({len(names)} matrices)"
        print(f"| {rows} | {label} | {best[0]:.1f} | {best[1]:.1f} | {best[2]:.1f} "
              f"| {over_float:.2f}x | {over_dense:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
