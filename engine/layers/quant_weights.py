"""A GPTQ / AWQ / compressed-tensors safetensors folder's quantized linears: found by their
tensors' names, left out of the dense load (each stands there as a meta tensor of its HF
shape, holding no bytes), and read into the CPU kernels' block layout
(engine.layers.quant_formats) for the ops to multiply in place."""

from __future__ import annotations

import contextlib
import logging

import torch
from safetensors import safe_open

from engine.layers.gguf_weights import QuantizedWeight
from engine.layers.quant_config import QuantScheme
from engine.layers.quant_formats import (
    SUFFIXES,
    UNPACKERS,
    ModuleTensors,
    to_blocks,
    to_half,
    unpack_gptq,
)
from engine.layers.safetensors_weights import safetensors_shards

log = logging.getLogger("sluice.engine")


def _split(stored: str, method: str) -> tuple[str, str] | None:
    """`model.layers.0.mlp.up_proj.qweight` -> (`model.layers.0.mlp.up_proj`, `qweight`) for a
    tensor of the format's; None for any other."""
    stem, _, suffix = stored.rpartition(".")
    return (stem, suffix) if stem and suffix in SUFFIXES[method] else None


def skipping_quantized(rename, scheme: QuantScheme):
    """`rename` that leaves the format's quantized tensors out of the dense load."""
    def renamed(stored: str) -> str | None:
        return None if _split(stored, scheme.method) is not None else rename(stored)

    return renamed


def _modules(folder: str, scheme: QuantScheme, rename, expected
             ) -> dict[str, tuple[str, dict[str, str]]]:
    """HF weight name -> (the checkpoint's module name, suffix -> shard file)."""
    found: dict[str, tuple[str, dict[str, str]]] = {}
    for shard in safetensors_shards(folder):
        with safe_open(shard, framework="pt") as f:
            for stored in f.keys():
                split = _split(stored, scheme.method)
                if split is None:
                    continue
                stem, suffix = split
                name = rename(f"{stem}.weight")
                if name is None:
                    continue
                if name not in expected or len(expected[name]) != 2:
                    raise ValueError(f"unexpected quantized tensor {stored!r} (no linear "
                                     f"{name} in this model)")
                found.setdefault(name, (stem, {}))[1][suffix] = shard
    for stem, _ in found.values():
        if scheme.weights_of(stem) is None:
            raise ValueError(f"{stem} is stored quantized, but quantization_config leaves it "
                             "unquantized (its ignore list or targets)")
    return found


def quantized_placeholders(folder: str, scheme: QuantScheme, rename, expected,
                           dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each quantized linear's weight as a meta tensor: its HF shape, no bytes (the ops
    hold its blocks: read_checkpoint_blocks)."""
    return {name: torch.empty(expected[name], dtype=dtype, device="meta")
            for name in _modules(folder, scheme, rename, expected)}


def read_checkpoint_blocks(folder: str, scheme: QuantScheme, rename, expected
                           ) -> dict[str, QuantizedWeight]:
    """Each quantized linear's blocks by HF weight name. fp16 scales and mins (20 bytes a
    32-weight block) where every block of every linear has fp16-exact ones (symmetric
    checkpoints), else float32 ones (24 bytes): one layout for all, so the fused q/k/v
    and gate/up parts always share theirs."""
    blocks, all_half = {}, True
    with contextlib.ExitStack() as stack:
        files: dict[str, object] = {}

        def opened(shard: str):
            if shard not in files:
                files[shard] = stack.enter_context(safe_open(shard, framework="pt"))
            return files[shard]

        for name, (stem, where) in _modules(folder, scheme, rename, expected).items():
            def get(suffix: str, stem=stem, where=where):
                shard = where.get(suffix)
                return None if shard is None else opened(shard).get_tensor(f"{stem}.{suffix}")

            tensors = ModuleTensors(stem, get, expected[name], scheme.weights_of(stem),
                                    scheme.method)
            if scheme.method == "gptq":
                unpacked = unpack_gptq(tensors, scheme.zero_plus_one)
            else:
                unpacked = UNPACKERS[scheme.method](tensors)
            blocks[name], half = to_blocks(unpacked, stem)
            all_half = all_half and half
    if all_half:  # one at a time: the wider copy of each is dropped as the next is made
        for name in list(blocks):
            blocks[name] = to_half(blocks[name])
    log.info("%s checkpoint: %d linears kept 4-bit, in the CPU kernels' blocks (%d bits a "
             "weight with the scales)", scheme.method, len(blocks), 5 if all_half else 6)
    return blocks
