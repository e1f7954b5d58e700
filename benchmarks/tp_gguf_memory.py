"""Memory per tensor-parallel rank for a Q4_K_M-style GGUF (issue 34): the dense weight bytes
and the quantized-block bytes each rank holds, and each rank's resident set, at --ranks 1
or 2 (run once per rank count: each run is a fresh process, so the RSS figures are its own).

The file is written here from random blocks (tests/unit/kquant_builders.py): a llama of
--hidden/--ffn/--layers, 16 heads over 4 KV heads, Q4_K with Q6_K for the output and for
attn_v/ffn_down in every other layer (llama.cpp's Q4_K_M mix), untied, in float32 (where
the CPU kernels multiply decode batches by the blocks). The engine is built in process
(`build_engine`, torch backend), as the tests build it; rank 1 is its worker process.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tp_gguf_memory.py --ranks 1
    PYTHONPATH=$PWD .venv/bin/python benchmarks/tp_gguf_memory.py --ranks 2

Prints one markdown table row per rank, then the decode step time of one greedy sequence
(a 64-token prompt, then --steps steps; best of 3 runs), which the blocks speed up.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from shared.config import EngineConfig
from tests.tiny_vlm import tiny_vlm_tokenizer
from tests.unit.engine_builders import request
from tests.unit.kquant_builders import LlamaShape, write_q4_k_m

MIB = 1 << 20


def rss(pid: int | str = "self") -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes: the process's own memory, and the pages of
    mapped files it has touched (the GGUF, which the page cache holds once per machine)."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                found[key] = int(value.split()[0]) * 1024
    return found["RssAnon"], found["RssFile"]


def above(now: tuple[int, int], bare: tuple[int, int]) -> str:
    return (f"{(now[0] - bare[0]) / MIB:.0f} MiB | {(now[1] - bare[1]) / MIB:.0f} MiB")


def held_bytes(model) -> tuple[int, int]:
    """(dense weight bytes, packed block bytes) a rank's model holds, each tensor once."""
    seen, dense = set(), 0
    tensors = [model.embed, model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [getattr(layer, f) for f in layer.__struct_fields__]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            dense += t.untyped_storage().nbytes()
    blocks = sum(q.blocks.numel() for q in getattr(model.ops, "_quantized", {}).values())
    return dense, blocks


def write_model(folder: str, args) -> str:
    shape = LlamaShape(hidden=args.hidden, ffn=args.ffn, heads=16, kv_heads=4,
                       layers=args.layers, vocab=args.vocab)
    q6_k = {"output.weight"} | {f"blk.{i}.{name}.weight" for i in range(0, args.layers, 2)
                                for name in ("attn_v", "ffn_down")}
    path = os.path.join(folder, "m.gguf")
    write_q4_k_m(path, shape, q6_k)
    tokenizer = os.path.join(folder, "tokenizer")  # --tokenizer: a folder with a config.json
    tiny_vlm_tokenizer().save_pretrained(tokenizer)  # a few words: speed needs no more
    with open(os.path.join(tokenizer, "config.json"), "w") as f:
        f.write("{}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    from engine.process.build import build_engine
    from shared.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        path = write_model(folder, args)
        load_tokenizer(os.path.join(folder, "tokenizer"))
        bare = rss()  # the engine imported, the tokenizer loaded: what any rank starts from
        core = build_engine(EngineConfig(
            model=path, tokenizer=os.path.join(folder, "tokenizer"), served_model_name="m", request_address="inproc://x",
            device="cpu", dtype="float32", attention_backend="torch", num_pages=64,
            page_size=16, threads=2, tensor_parallel_size=args.ranks, max_model_len=256))
        model = core.runner.model
        inner = getattr(model, "inner", model)
        dense, blocks = held_bytes(inner)
        print(f"file: {os.path.getsize(path) / MIB:.0f} MiB; bare process "
              f"{bare[0] / MIB:.0f} MiB anonymous, {bare[1] / MIB:.0f} MiB file-backed")
        print("| ranks | rank | dense weights | blocks | anonymous RSS above the bare process "
              "| file-backed RSS above it |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(f"| {args.ranks} | 0 | {dense / MIB:.0f} MiB | {blocks / MIB:.0f} MiB | "
              f"{above(rss(), bare)} |")
        for rank, proc in getattr(model, "procs", []):  # its bare start taken as rank 0's
            print(f"| {args.ranks} | {rank} | as rank 0 | as rank 0 | "
                  f"{above(rss(proc.pid), bare)} |")
        best = min(decode_ms(core, args.steps, run) for run in range(3))
        print(f"decode: {best:.1f} ms per step, 1 sequence")
        if args.ranks > 1:
            model.close()


def decode_ms(core, steps: int, run: int) -> float:
    core.add(request(f"r{run}", [(7 * i + run) % 250 + 1 for i in range(64)],
                     max_tokens=steps + 1, ignore_eos=True))
    core.step()  # the whole prompt (512 tokens a step) and the first token
    count, start = 0, time.perf_counter()
    while core.has_work:
        core.step()
        count += 1
    return (time.perf_counter() - start) * 1e3 / count


if __name__ == "__main__":
    main()
