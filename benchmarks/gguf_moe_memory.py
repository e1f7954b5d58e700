"""A GGUF MoE's experts held as their blocks alone against dequantized at load (issue 32):
the engine's memory and a prefill and a decode step's time, each mode in a fresh process.

  dense:  what the engine did before: every expert dequantized to float32 at load (the
          blocks kept beside, for decode steps of up to 16 rows an expert)
  blocks: every expert only its blocks (the block kernel up to BLOCKS_ONLY_MAX_ROWS rows,
          past it that expert dequantized for the call and F.linear)
  kernel: blocks, with the block kernel at every row count (the other choice for prefill)

Memory: anonymous RSS (the process's own pages, not the file's page cache) above the same
process before the model loads, and the bytes of the tensors the model and its ops hold.
The file is a qwen3moe of random blocks (tests/unit/kquant_builders.py `write_moe_kquant`:
experts' gate/up Q4_K, down Q6_K, as a Q4_K_M file's; attention and LM head Q8_0).

    .venv/bin/python benchmarks/gguf_moe_memory.py --threads 1
    .venv/bin/python benchmarks/gguf_moe_memory.py --crossover   # one expert, by row count

Prints markdown tables. Times are this thread's CPU time (meaningful with --threads 1 on a
shared machine) and wall time, best of --repeats.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

SHAPE = dict(hidden=1024, expert_ffn=512, experts=16, top_k=2, layers=4, vocab=2048)


def anon_rss() -> int:
    """This process's anonymous resident bytes (/proc/self/status RssAnon)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def best(step, repeats: int) -> tuple[float, float]:
    """(thread CPU ms, wall ms), each the best of `repeats` runs after one warm run."""
    step()
    cpu = wall = float("inf")
    for _ in range(repeats):
        c, w = time.thread_time(), time.perf_counter()
        step()
        cpu, wall = min(cpu, time.thread_time() - c), min(wall, time.perf_counter() - w)
    return cpu * 1e3, wall * 1e3


def measure(path: str, mode: str, isa: str, repeats: int, dtype: torch.dtype) -> dict:
    """One mode's numbers (run in a process of its own)."""
    import engine.layers.cpu_ops as ops_module
    from engine.kernels.cpu_kernels import kernels_for
    from tests.unit.engine_builders import drain, request
    from tests.unit.kquant_builders import engine_core
    from tests.unit.test_kquant_kernels import _held_bytes

    compiled = kernels_for(isa)
    if mode == "kernel":
        ops_module.BLOCKS_ONLY_MAX_ROWS = ops_module.BLOCKS_ONLY_MAX_ROWS_BF16 = 1 << 30
    gc.collect()
    bare = anon_rss()
    core, _ = engine_core(path, compiled, dtype, blocks_only=mode != "dense", max_len=512,
                          budget=256)
    gc.collect()
    loaded = anon_rss() - bare
    held = _held_bytes(core.runner.model)
    prompts = iter(range(1, 1 << 20))
    prompt = [(7 * i) % SHAPE["vocab"] for i in range(256)]

    def prefill() -> None:  # one step: a 256-token prompt no earlier one shares a page with
        first = next(prompts)
        core.add(request(f"p{first}", [first, *prompt[1:]], max_tokens=1))
        drain(core)

    def decode() -> None:  # 16 decode steps of one sequence (1 row an expert)
        core.add(request("d", prompt[:8], max_tokens=17))
        core.step()  # the prompt
        while core.has_work:
            core.step()

    prefill_cpu, prefill_wall = best(prefill, repeats)
    decode_cpu, decode_wall = best(decode, repeats)
    return dict(loaded=loaded, held=held, prefill_cpu=prefill_cpu, prefill_wall=prefill_wall,
                decode_cpu=decode_cpu / 16, decode_wall=decode_wall / 16)


def crossover(isa: str, repeats: int, dtype: torch.dtype) -> None:
    """One expert's gate+up (Q4_K) and down (Q6_K) at each row count: the block kernel
    against dequantizing it for the call (rounded to `dtype`) and F.linear, thread CPU ms."""
    from engine.kernels.cpu_kernels import kernels_for
    from engine.layers.cpu_ops import ANY_KIND_LAYOUT
    from engine.layers.gguf_weights import BLOCK_KINDS
    from tests.unit.kquant_builders import random_blocks

    k = kernels_for(isa)
    hidden, ffn = SHAPE["hidden"], SHAPE["expert_ffn"]
    q4k = BLOCK_KINDS["Q4_K"]
    gate_up = k.pack_blocks(torch.from_numpy(random_blocks("Q4_K", 2 * ffn, hidden, 1)), q4k)
    down = k.pack_blocks(torch.from_numpy(random_blocks("Q6_K", hidden, ffn, 2)),
                         BLOCK_KINDS["Q6_K"])
    print(f"\n{isa} build, {torch.get_num_threads()} thread(s): one expert's gate+up "
          f"[{2 * ffn}, {hidden}] Q4_K then down [{hidden}, {ffn}] Q6_K, {dtype} rows, "
          "thread CPU ms (best of %d)\n" % repeats)
    print("| rows | block kernel | dequantize + F.linear |")
    print("|---:|---:|---:|")
    for rows in (4, 8, 16, 24, 32, 64, 128, 256):
        x = torch.randn(rows, hidden).to(dtype)
        h = torch.randn(rows, ffn).to(dtype)

        def kernel(x=x, h=h):
            k.quantized_linear(x, gate_up, q4k)
            k.quantized_linear(h, down, ANY_KIND_LAYOUT)

        def dense(x=x, h=h):
            F.linear(x, k.dequantize_blocks(gate_up, q4k).to(dtype))
            F.linear(h, k.dequantize_blocks(down, ANY_KIND_LAYOUT).to(dtype))

        print(f"| {rows} | {best(kernel, repeats)[0]:.2f} | {best(dense, repeats)[0]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="native", choices=["native", "avx2"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["dense", "blocks", "kernel"])
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's (and --crossover's rows')")
    parser.add_argument("--one", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:  # the child: one mode, JSON out
        print(json.dumps(measure(*args.one, args.isa, args.repeats, getattr(torch, args.dtype))))
        return
    if args.crossover:
        crossover(args.isa, args.repeats, getattr(torch, args.dtype))
        return
    from tests.unit.kquant_builders import MoeShape, write_moe_kquant

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "moe-q4_k_m.gguf")
        write_moe_kquant(path, MoeShape(**SHAPE))
        size = os.path.getsize(path)
        rows = {}
        for mode in args.modes:
            out = subprocess.run(
                [sys.executable, __file__, "--one", path, mode, "--isa", args.isa,
                 "--threads", str(args.threads), "--repeats", str(args.repeats),
                 "--dtype", args.dtype],
                check=True, capture_output=True, text=True).stdout
            rows[mode] = json.loads(out.strip().splitlines()[-1])
    mb = 1 << 20
    print(f"qwen3moe {SHAPE}, file {size / mb:.1f} MiB; {args.dtype}, {args.isa} build, "
          f"{args.threads} thread(s)\n")
    print("| experts | anon RSS above bare (MiB) | tensors held (MiB) | prefill 256 tokens "
          "(ms, CPU / wall) | decode 1 sequence (ms a token, CPU / wall) |")
    print("|---|---:|---:|---:|---:|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['loaded'] / mb:.1f} | {r['held'] / mb:.1f} | "
              f"{r['prefill_cpu']:.1f} / {r['prefill_wall']:.1f} | "
              f"{r['decode_cpu']:.2f} / {r['decode_wall']:.2f} |")


if __name__ == "__main__":
    main()
