"""One decode step's linears on the default checkpoint, per kernel build: the time to multiply
1-4 rows by every weight of SmolLM2 once (30 layers' q/k/v/o, gate/up, down, and the LM
head), with the GGUF blocks in place (`quantized_linear`) and over dense weights (`F.linear`
in float32, what an AVX2-only CPU ran for dense weights; `dense_linear` of float32 rows by
bfloat16 weights, which the kernel widens: what a float32 model now runs there).

    .venv/bin/python benchmarks/decode_linears.py                  # native and avx2 builds
    .venv/bin/python benchmarks/decode_linears.py --isa avx2 --threads 1

Prints one markdown table: milliseconds per step (lower is better), best of --repeats.
`--clock thread` counts this thread's CPU time instead of wall time: on a shared machine it
leaves out the time other tenants hold the core (meaningful with --threads 1 only).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.kernels.cpu_kernels import ISA_MARCH, cpu_runs, kernels_for
from engine.models.registry import load_model_config, load_quantized_weights, load_weights
from shared.model_source import default_model_path


def best_ms(step, repeats: int, clock) -> float:
    step()  # warm: first-touch of the weights, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        step()
        best = min(best, clock() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", nargs="+", default=list(ISA_MARCH), choices=list(ISA_MARCH))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time

    path = default_model_path()
    config = load_model_config(path)
    quantized = load_quantized_weights(path, config)
    dense = {name: w for name, w in load_weights(path, config, torch.float32).items()
             if name in quantized}
    dense_bf16 = {name: w.bfloat16() for name, w in dense.items()}
    gen = torch.Generator().manual_seed(0)
    inputs = {(rows, k): torch.randn(rows, k, generator=gen)
              for rows in args.rows for k in {w.shape[1] for w in dense.values()}}

    print("| build | threads | rows | Q4_1/Q8_0 blocks (ms) | float32 F.linear (ms) "
          "| bf16 weights, widened (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for isa in args.isa:
        module = kernels_for(isa) if cpu_runs(isa) else None
        if module is None:
            print(f"| {isa} | - | - | not runnable here | | |")
            continue
        packed = {name: (module.pack_blocks(q.blocks, q.kind), q.kind)
                  for name, q in quantized.items()}
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = {name: inputs[rows, w.shape[1]] for name, w in dense.items()}

                def blocks(x=x, module=module, packed=packed):
                    for name, (p, kind) in packed.items():
                        module.quantized_linear(x[name], p, kind)

                def float32(x=x):
                    for name, w in dense.items():
                        F.linear(x[name], w)

                def bf16(x=x, module=module):
                    for name, w in dense_bf16.items():
                        module.dense_linear(x[name], w)

                times = [best_ms(step, args.repeats, clock) for step in (blocks, float32, bf16)]
                print(f"| {isa} | {threads} | {rows} | "
                      + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
