"""Decode at concurrency 1 on a Q4_K_M-style GGUF, before and after the CPU kernels took
k-quant blocks (issue 29): "dense" runs the weights dequantized at load (all k-quants got
before), "blocks" multiplies decode steps by the file's Q4_K/Q6_K blocks in place.

The file is written here from random blocks (tests/unit/kquant_builders.py: gguf-py cannot
quantize k-quants): a llama of --hidden/--ffn/--layers, Q4_K with Q6_K for the output and
for attn_v/ffn_down in every other layer, as llama.cpp's Q4_K_M mix does (those layers'
q/k/v fuse mixed kinds and stay dense). Its sizes are multiples of 256, as k-quants need;
the default SmolLM2's 576 is not.

    .venv/bin/python benchmarks/kquant_decode.py                 # native and avx2 builds
    .venv/bin/python benchmarks/kquant_decode.py --isa avx2 --tokens 64

Prints one markdown table: ms per decoded token (best of --repeats runs of --tokens tokens;
wall and this thread's CPU time, on --threads torch threads) and tokens/s by wall time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from engine.kernels.cpu_kernels import ISA_MARCH, cpu_runs, kernels_for
from tests.unit.engine_builders import request
from tests.unit.kquant_builders import LlamaShape, engine_core, write_q4_k_m


def decode_ms(core, tokens: int) -> tuple[float, float]:
    """(wall, thread CPU) ms per token of one greedy request's decode steps."""
    core.add(request("bench", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=tokens + 1))
    core.step()  # the prompt, and the first token
    steps, wall, cpu = 0, time.perf_counter(), time.thread_time()
    while core.has_work:
        core.step()
        steps += 1
    return ((time.perf_counter() - wall) * 1e3 / steps, (time.thread_time() - cpu) * 1e3 / steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", nargs="+", default=list(ISA_MARCH), choices=list(ISA_MARCH))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = LlamaShape(hidden=args.hidden, ffn=args.ffn, heads=args.hidden // 64,
                       kv_heads=max(1, args.hidden // 256), layers=args.layers,
                       vocab=args.vocab)
    q6_k = {"output.weight"} | {f"blk.{i}.{name}.weight" for i in range(0, args.layers, 2)
                                for name in ("attn_v", "ffn_down")}
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "q4_k_m-style.gguf")
        write_q4_k_m(path, shape, q6_k)
        print("| build | dtype | weights | ms/token (wall) | ms/token (thread CPU) | tokens/s |")
        print("|---|---|---|---:|---:|---:|")
        for isa in args.isa:
            module = kernels_for(isa) if cpu_runs(isa) else None
            if module is None:
                print(f"| {isa} | not runnable here | | | | |")
                continue
            dtypes = [torch.float32] + ([torch.bfloat16] if module.bf16_quantized else [])
            for dtype in dtypes:
                for blocks in (False, True):
                    core, _ = engine_core(path, module, dtype, blocks, max_len=args.tokens + 16)
                    decode_ms(core, 4)  # warm: first touch of the weights
                    wall, cpu = min(decode_ms(core, args.tokens) for _ in range(args.repeats))
                    print(f"| {isa} | {str(dtype).removeprefix('torch.')} | "
                          f"{'blocks' if blocks else 'dense'} | {wall:.1f} | {cpu:.1f} | "
                          f"{1e3 / wall:.1f} |", flush=True)
                    del core


if __name__ == "__main__":
    main()
