"""The CPU kernels' norms and RoPE (engine/kernels/csrc/cpu_kernels.cpp), one call at a time,
against another build of the kernels (an older source's, to measure a change): RMSNorm over
SmolLM2's hidden rows (576), the per-head q/k norm of a Qwen3-style model (9 heads of 64),
the residual add fused with RMSNorm, and RoPE over SmolLM2's q and k (9 + 3 heads of 64).

    .venv/bin/python benchmarks/norm_rope_kernels.py --isa avx2 \\
        --before /tmp/sluice_cpu_kernels_<cpu>_avx2_<old source>.so

A build of an older source: check it out (or `git show REV:engine/kernels/csrc/cpu_kernels.cpp`
into a checkout) and run `SLUICE_CPU_ISA=avx2 python -m engine.kernels.cpu_kernels` there; the
.so it prints is what --before takes. Prints one markdown table: microseconds per call, best
of --repeats runs of --calls calls, one thread, this thread's CPU time by default (on a
shared machine it leaves out the time other tenants hold the core).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from engine.kernels.cpu_kernels import ISA_MARCH, kernels_for

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, POSITIONS = 576, 9, 3, 64, 4096


def load_build(path: str):
    """A kernels module from its .so (the file's stem is the module's name)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_us(call, calls: int, repeats: int, clock) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            call()
        best = min(best, (clock() - start) / calls)
    return best * 1e6


def cases(rows: int, dtype: torch.dtype):
    """(name, f(module)) for each kernel at this row count and dtype."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    delta = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    heads = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    head_weight = weight[:HEAD_DIM].contiguous()
    angles = torch.rand(POSITIONS, HEAD_DIM, generator=gen) * 6.3  # the kernel reads any table
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, POSITIONS, (rows,), generator=gen)
    return [
        ("rms_norm", lambda m: m.rms_norm(x, weight, 1e-5)),
        ("rms_norm per head", lambda m: m.rms_norm(heads, head_weight, 1e-6)),
        ("add_rms_norm", lambda m: m.add_rms_norm(x, delta, weight, 1e-5)),
        ("rope", lambda m: m.rope(q, k, cos, sin, positions)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="avx2", choices=list(ISA_MARCH))
    parser.add_argument("--before", required=True, help="the .so of the build to compare")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=["wall", "thread"], default="thread")
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(1)
    before, after = load_build(args.before), kernels_for(args.isa)
    if after is None:
        raise SystemExit(f"the {args.isa} build could not be built here")
    print(f"before: {Path(args.before).name} ({before.simd}); after: {after.__name__} "
          f"({after.simd})\n")
    print("| kernel | dtype | rows | before (us) | after (us) | speed-up |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in args.rows:
            calls = max(1, args.calls // max(1, rows // 16))  # ~the same time per row count
            for name, call in cases(rows, dtype):
                old = best_us(lambda call=call: call(before), calls, args.repeats, clock)
                new = best_us(lambda call=call: call(after), calls, args.repeats, clock)
                kind = str(dtype).removeprefix("torch.")
                print(f"| {name} | {kind} | {rows} | {old:.1f} | {new:.1f} | {old / new:.1f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
