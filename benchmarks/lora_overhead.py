"""The cost of LoRA (issue 36): output tokens per second at a given concurrency with 0, 1
and 4 adapters in the batch, on one in-process engine.

The engine is built once on the default model with --enable-lora and --max-loras 4; four
random rank-R adapters on every q/k/v/o/gate/up/down projection are written as PEFT folders
and loaded. A run adds `concurrency` greedy requests at once (the mixed prompts of `sluice
bench`, cycled) and steps until all finish; the requests use no adapter (0), all the same
adapter (1), or the four adapters in turn (4). Sides alternate in order round by round;
reported: the median and best tok/s of each side and their ratio to the base side.

    .venv/bin/python benchmarks/lora_overhead.py [--concurrency 16] [--rounds 3]
        [--max-tokens 64] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from engine.layers.lora_ops import TARGETS
from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.model_source import default_model_path, served_model_name
from shared.protocol import EngineRequest, LoraAdapterInfo, SamplingParams, pack_ids
from shared.tokenizer import load_tokenizer
from sluice.bench.chat import BUILTIN_PROMPTS

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(path: str, model, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder for `model` (small B, so answers stay sensible)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(model.layers):
        for module in MODULES:
            attr, part = TARGETS[module]
            weight = getattr(layer, attr)
            out = weight.shape[0]
            if attr == "qkv_weight":
                kv = model.kv_size
                out = [out - 2 * kv, kv, kv][part]
            elif attr == "gate_up_weight":
                out //= 2
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{kind}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, weight.shape[1], generator=gen)
            tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(out, rank, generator=gen)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES,
                   "peft_type": "LORA"}, f)


def one_run(core, prompts, loras, max_tokens: int, tag: str) -> float:
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        core.add(EngineRequest(f"{tag}-{i}", pack_ids(ids),
                               SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                              ignore_eos=True),
                               "inproc://bench", time.time(), lora_name=loras[i % len(loras)]))
    produced = 0
    while core.has_work:
        for _, out in core.step():
            produced += len(out.new_token_ids) // 4
    return produced / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    model = default_model_path()
    core = build_engine(EngineConfig(
        model=model, served_model_name=served_model_name(model), request_address="inproc://x",
        enable_lora=True, max_loras=4, max_lora_rank=args.rank, threads=args.threads,
        max_num_seqs=max(args.concurrency, 16)))
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(4):
            path = os.path.join(tmp, f"lora{n}")
            write_adapter(path, core.runner.model, args.rank, n)
            core.lora.load(LoraAdapterInfo(f"lora{n}", path))
    tok = load_tokenizer(model)
    chats = BUILTIN_PROMPTS["mixed"]
    rendered = [tok.apply_chat_template([{"role": "user", "content": chats[i % len(chats)]}],
                                        add_generation_prompt=True, tokenize=False)
                for i in range(args.concurrency)]
    prompts = [tok.encode(text, add_special_tokens=False) for text in rendered]
    sides = {"0 adapters": [None], "1 adapter": ["lora0"],
             "4 adapters": ["lora0", "lora1", "lora2", "lora3"]}
    one_run(core, prompts, [None], 4, "warm")
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            rates[name].append(one_run(core, prompts, sides[name], args.max_tokens,
                                       f"{r}-{name[0]}"))
    base = statistics.median(rates["0 adapters"])
    best_base = max(rates["0 adapters"])
    print(f"model {served_model_name(model)}, ops {core.runner.model.ops.name}, concurrency "
          f"{args.concurrency}, rank {args.rank}, {args.max_tokens} tokens, {args.rounds} rounds")
    print("| adapters in the batch | tok/s (median) | tok/s (best) | ratio (median) "
          "| ratio (best) |")
    for name, values in rates.items():
        med, best = statistics.median(values), max(values)
        print(f"| {name} | {med:.0f} | {best:.0f} | {med / base:.2f}× | {best / best_base:.2f}× |")
    print("per round:", {k: [round(v) for v in vs] for k, vs in rates.items()})


if __name__ == "__main__":
    main()
