"""GGUF files into HF tensor names: dequantized tensors (q/k un-permuted as transformers
does), or, for the CPU kernels, the linears' blocks as the file stores them."""

from __future__ import annotations

import logging

import gguf
import msgspec
import numpy as np
import torch

from engine.layers.checkpoint_names import GGUF_LAYER_NAMES, CheckpointNames
from engine.layers.config import ModelConfig, gguf_reader

log = logging.getLogger("sluice.engine")

# llama.cpp's stacked experts [experts, out, in] -> each expert's HF projection.
_GGUF_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                      "ffn_down_exps": "down_proj"}
# Tensors a GGUF file stores that are configuration, read by engine.layers.config.
_GGUF_CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight",
                        "rope_factors_short.weight"}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def load_gguf(path, config, names: CheckpointNames, dtype, take, shard=None,
               experts_as_blocks=None) -> dict[str, torch.Tensor]:
    weights = {}
    expected, layer_names, regroup = names.shapes, names.gguf_layer_names, names.gguf_tensors
    tensors = gguf_reader(path).tensors
    as_blocks = _block_expert_layers(tensors) if experts_as_blocks is not None else set()
    if regroup is not None:  # a family whose file holds its tensors in another grouping
        return _load_regrouped(tensors, names, dtype, take, as_blocks, experts_as_blocks)
    for tensor in tensors:
        if tensor.name in _GGUF_CONFIG_TENSORS:
            continue
        experts = _expert_names(tensor.name, int(tensor.shape[-1]))  # ggml: experts last
        if experts is not None:
            unexpected = [name for name in experts if name not in expected]
            if unexpected:
                raise ValueError(f"unexpected GGUF tensor {tensor.name!r} (no "
                                 f"{unexpected[0]} in this model)")
            if shard is not None:  # each expert's part, as a 2-D tensor's
                stored = (int(tensor.shape[1]), int(tensor.shape[0]))
                weights.update({name: _gguf_part(
                    tensor.data[e], tensor.tensor_type, tensor.name, name, stored,
                    expected[name], config, dtype, shard) for e, name in enumerate(experts)})
                continue
            if _as_blocks(tensor.name, as_blocks):
                # Shape-checked like the rest; the bytes stay the file's blocks.
                shape = tuple(int(n) for n in reversed(tensor.shape[:-1]))  # ggml: reversed
                weights.update({name: torch.empty(shape, dtype=experts_as_blocks,
                                                  device="meta") for name in experts})
                continue
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            weights.update({name: take(name, _to_torch(array[e], dtype))
                            for e, name in enumerate(experts)})
            continue
        name = gguf_hf_name(tensor.name, layer_names)
        if name not in expected:
            raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
        if shard is not None and len(tensor.shape) == 2:
            stored = (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml's order: [in, out]
            weights[name] = _gguf_part(tensor.data, tensor.tensor_type, tensor.name, name,
                                       stored, expected[name], config, dtype, shard)
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = _undo_rope_permute(array, tensor.name, config)
        weights[name] = take(name, _to_torch(array, dtype))
    return weights


def _load_regrouped(tensors, names: CheckpointNames, dtype, take, as_blocks: set[str],
                    experts_as_blocks) -> dict[str, torch.Tensor]:
    """A family's tensors that its `gguf_tensors` regroups from the file's (gpt-oss)."""
    weights = {}
    expected, layer_names = names.shapes, names.gguf_layer_names
    arrays = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in tensors
              if t.name not in _GGUF_CONFIG_TENSORS and not _as_blocks(t.name, as_blocks)}
    named = names.gguf_tensors(arrays, lambda name: gguf_hf_name(name, layer_names))
    for name, array in named.items():
        if name not in expected:
            raise ValueError(f"unexpected GGUF tensor for {name!r}")
        weights[name] = take(name, _to_torch(array, dtype))
    # The experts left as blocks: their stacked weights, in the checkpoint's grouping,
    # stand as meta tensors (the model views each expert of them; the ops hold the
    # blocks, or the model refuses to start).
    for layer in as_blocks:
        prefix = f"model.layers.{layer}.mlp.experts."
        weights.update({name: torch.empty(shape, dtype=experts_as_blocks, device="meta")
                        for name, shape in expected.items() if name.startswith(prefix)
                        and name not in weights and not name.endswith("bias")})
    return weights


def _gguf_part(data: np.ndarray, qtype, gguf_name: str, name: str, stored: tuple[int, int],
               shape: tuple[int, ...], config: ModelConfig, dtype: torch.dtype, shard
               ) -> torch.Tensor:
    """A tensor-parallel rank's part of a 2-D GGUF tensor (or one expert's of a stacked
    one), `data` as the file stores it ([out, blocks' bytes], or [out, in] values), `stored`
    its [out, in]: only the blocks the part lies in are dequantized (whole blocks, then
    narrowed), so no rank dequantizes the whole tensor."""
    if stored != shape:  # checked whole, before it is cut
        raise ValueError(f"{name} has shape {stored}, expected {shape}")
    block = gguf.GGML_QUANT_SIZES[qtype][0]  # weights a block
    units = data.shape[1] // (shape[1] // block)  # data columns a block (bytes, or 1 value)

    def read(dim: int, start: int, stop: int) -> torch.Tensor:
        if start == stop:  # a part held by another rank only
            return torch.zeros((0, shape[1]) if dim == 0 else (shape[0], 0), dtype=dtype)
        if dim == 0:  # whole rows; q/k: whole heads, un-permuted as the full tensor is
            array = gguf.quants.dequantize(np.ascontiguousarray(data[start:stop]), qtype)
            array = _undo_rope_permute(array, gguf_name, config)
        else:
            first, end = start // block, -(-stop // block)
            cut = np.ascontiguousarray(data[:, first * units:end * units])
            offset = first * block
            array = gguf.quants.dequantize(cut, qtype)[:, start - offset:stop - offset]
        return _to_torch(array, dtype)

    return shard.take_from(name, shape, read)


# GGUF block formats the CPU kernels multiply in place (engine/kernels/csrc/cpu_kernels.cpp),
# by the kernel's number for them: Q4_1 and Q8_0 (32-weight blocks), and the k-quants of
# most GGUF files on the Hub (256-weight blocks: Q4_K_M files hold Q4_K and Q6_K, Q5_K_M
# files Q5_K and Q6_K), and MXFP4 (32-weight blocks: gpt-oss files' experts).
BLOCK_KINDS = {"Q4_1": 0, "Q8_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4, "MXFP4": 5}
MXFP4_BLOCK = 32  # values per shared scale: 16 bytes of two codes each


class QuantizedWeight(msgspec.Struct, frozen=True):
    """A linear weight as the checkpoint stores it: rows of GGUF blocks of one kind."""

    kind: int  # BLOCK_KINDS value
    blocks: torch.Tensor  # uint8 [out, in / block weights * block bytes]
    # Already in the kernels' packed layout for `kind` (a GPTQ/AWQ/compressed-tensors
    # checkpoint's, engine.layers.quant_formats), not GGUF blocks to repack.
    packed: bool = False
    # The input columns in the blocks' order (a GPTQ desc_act checkpoint's), None: in order.
    perm: torch.Tensor | None = None


def read_quantized_weights(model_path: str, config: ModelConfig, names: CheckpointNames,
                           shard=None) -> dict[str, QuantizedWeight]:
    """The 2-D tensors of a GGUF file stored in a block format the CPU kernels take, by HF
    name, rows in HF order (q/k un-permuted as `read_weights` does), and each expert of a
    stacked MoE tensor (`ffn_*_exps`) so stored, under the expert's HF name: a view of the
    stacked blocks in the file (an expert's rows are a contiguous run of them). Empty for
    anything else.
    shard: a tensor-parallel rank's `engine.layers.sharding.Shard`: each tensor's blocks
    are cut to the rank's part as they are read (`Shard.take_blocks`), before anything is
    copied; a row-parallel tensor whose cut falls inside a block is left out (the rank
    multiplies its dense slice), and so are experts (a rank multiplies its dense part of
    each)."""
    if not model_path.endswith(".gguf"):
        return {}
    found, dense = {}, []
    layer_names = names.gguf_layer_names
    for tensor in gguf_reader(model_path).tensors:
        kind = BLOCK_KINDS.get(tensor.tensor_type.name)
        if kind is not None and len(tensor.shape) == 3:
            experts = _expert_names(tensor.name, tensor.data.shape[0])
            if experts is not None and shard is None:
                # [experts, out, row bytes], mapped copy-on-write (never written): the page
                # cache holds the blocks, not the engine's private memory.
                stacked = np.memmap(model_path, np.uint8, "c", tensor.data_offset,
                                    tensor.data.shape)
                blocks = torch.from_numpy(stacked)
                found.update({n: QuantizedWeight(kind, b)
                              for n, b in zip(experts, blocks, strict=True)})
            continue
        name = gguf_hf_name(tensor.name, layer_names)
        if kind is None or name is None or len(tensor.shape) != 2:
            continue
        rows = np.asarray(tensor.data)  # a view of the memory-mapped file
        if shard is not None:  # whole heads of q/k: un-permuted after the cut just the same
            rows = shard.take_blocks(name, rows, *gguf.GGML_QUANT_SIZES[tensor.tensor_type])
            if rows is None:
                dense.append(name)
                continue
        rows = _undo_rope_permute(rows, tensor.name, config)
        found[name] = QuantizedWeight(kind, torch.from_numpy(np.ascontiguousarray(rows).copy()))
    if dense and shard.rank == 0:  # the same cuts on every rank: said once
        log.info("tensor-parallel GGUF: %d of %d quantized matrices are cut inside a block at "
                 "%d ranks and multiplied by their dense slices (e.g. %s)", len(dense),
                 len(dense) + len(found), shard.size, dense[0])
    return found


def _block_expert_layers(tensors) -> set[str]:
    """The layers (GGUF block numbers, as text) whose stacked expert tensors are all stored
    in a kind the CPU kernels multiply (BLOCK_KINDS): one expert's gate, up and down then
    all come from blocks, never half from a dequantized copy."""
    kinds: dict[str, set[bool]] = {}
    for tensor in tensors:
        if _expert_names(tensor.name, 0) is not None and tensor.name.endswith(".weight"):
            layer = tensor.name.split(".")[1]
            kinds.setdefault(layer, set()).add(tensor.tensor_type.name in BLOCK_KINDS)
    return {layer for layer, found in kinds.items() if found == {True}}


def _as_blocks(gguf_name: str, layers: set[str]) -> bool:
    """Whether `gguf_name` is a stacked expert weight of one of `layers` (from
    _block_expert_layers): left as its blocks, not dequantized."""
    return (gguf_name.endswith(".weight") and _expert_names(gguf_name, 0) is not None
            and gguf_name.split(".")[1] in layers)


def _expert_names(gguf_name: str, count: int) -> list[str] | None:
    """`blk.3.ffn_up_exps.weight` holding `count` experts -> each expert's HF name under
    model.layers.3.mlp; None for any other tensor."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_EXPERT_NAMES:
        return None
    proj = _GGUF_EXPERT_NAMES[parts[2]]
    return [f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{parts[3]}"
            for e in range(count)]


def gguf_hf_name(gguf_name: str, layer_names: dict[str, str] = GGUF_LAYER_NAMES) -> str | None:
    """Map `blk.3.attn_q.weight` to `model.layers.3.self_attn.q_proj.weight`; None if unknown.
    layer_names: the family's block names (CheckpointNames.gguf_layer_names)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    return None


def _undo_rope_permute(array: np.ndarray, gguf_name: str, config: ModelConfig) -> np.ndarray:
    """Reverse llama.cpp's q/k row permutation, exactly as transformers does.

    For llama, convert_hf_to_gguf.py reorders each head's rows from HF's half-split rotary
    layout (first half / second half) to ggml's interleaved pairs. Qwen models use ggml's NEOX
    rope and are stored unpermuted.
    """
    if config.architecture != "llama":
        return array
    if ".attn_q." not in gguf_name and ".attn_k." not in gguf_name:
        return array
    # Whole heads: the tensor's (num_heads or num_kv_heads), or a tensor-parallel rank's.
    n_head = array.shape[0] // config.head_dim
    # Within a head, GGUF row 2j+p holds HF row p*half+j (p picks the rotary half).
    half = array.shape[0] // n_head // 2
    grouped = array.reshape(n_head, half, 2, *array.shape[1:])
    return grouped.swapaxes(2, 1).reshape(array.shape)


def _to_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    # F32 tensors come back as read-only views of the memory-mapped file; copy those so the
    # result owns its memory and torch does not warn about a non-writable buffer.
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).to(dtype)
