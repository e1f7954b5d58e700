"""Tiny 4-bit checkpoints written by hand to each format's specification (AutoGPTQ's GPTQ v1 /
v2, AutoAWQ's GEMM layout, compressed-tensors' pack-quantized), from a transformers model
whose linears are first snapped to the 4-bit grid: the model then IS the dequantized
checkpoint, the float32 reference the engine is compared with."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Linears that share one input, so one g_idx order (GPTQ computes it from that input).
_SAME_INPUT = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
               "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up"}
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


class Quantized:
    """One linear on the 4-bit grid: w = scale[:, g] * (codes - zero[:, g]), g = g_idx[i]."""

    def __init__(self, codes, scale, zero, g_idx):
        self.codes, self.scale, self.zero, self.g_idx = codes, scale, zero, g_idx

    def dequantized(self) -> torch.Tensor:
        s, z = self.scale.float()[:, self.g_idx], self.zero.float()[:, self.g_idx]
        return s * (self.codes.float() - z)


def quantize(w: torch.Tensor, group: int, sym: bool, scale_dtype, g_idx=None) -> Quantized:
    out, inp = w.shape
    size = inp if group == -1 else group
    groups = -(-inp // size)
    g_idx = torch.arange(inp) // size if g_idx is None else g_idx
    scale, zero = torch.empty(out, groups), torch.empty(out, groups)
    for g in range(groups):
        part = w[:, g_idx == g]
        if sym:
            s = part.abs().amax(1).clamp_min(1e-4) / 7
            z = torch.full((out,), 8.0)
        else:
            lo, hi = part.amin(1).clamp_max(0), part.amax(1).clamp_min(0)
            s = ((hi - lo) / 15).clamp_min(1e-4)
            z = (-lo / s.to(scale_dtype).float()).round().clamp(0, 15)
        scale[:, g], zero[:, g] = s.to(scale_dtype).float(), z
    s, z = scale[:, g_idx], zero[:, g_idx]
    codes = (w / s).round().add(z).clamp(0, 15).to(torch.uint8)
    return Quantized(codes, scale.to(scale_dtype), zero.to(torch.int64), g_idx)


def pack(values: torch.Tensor, dim: int, order=range(8)) -> torch.Tensor:
    """4-bit values -> int32 words along `dim`, nibble i of word c holding value 8c + order[i]."""
    v = values.to(torch.int64).numpy().astype(np.uint32)
    v = v if dim == 1 else v.T
    pad = -v.shape[1] % 8
    v = np.pad(v, [(0, 0), (0, pad)])
    words = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for i, j in enumerate(order):
        words |= v[:, j::8] << (4 * i)
    words = words if dim == 1 else words.T
    return torch.from_numpy(np.ascontiguousarray(words).view(np.int32))


def gptq_tensors(q: Quantized, v1: bool = True) -> dict[str, torch.Tensor]:
    zeros = (q.zero - 1) & 0xF if v1 else q.zero  # v1 stores each zero point less one
    return {"qweight": pack(q.codes.T, 0), "qzeros": pack(zeros.T, 1),
            "scales": q.scale.T.contiguous().half(), "g_idx": q.g_idx.to(torch.int32)}


def awq_tensors(q: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": pack(q.codes.T, 1, _AWQ_ORDER), "qzeros": pack(q.zero.T, 1, _AWQ_ORDER),
            "scales": q.scale.T.contiguous().half()}


def ct_tensors(q: Quantized, sym: bool) -> dict[str, torch.Tensor]:
    # Stored q + 8 (q signed); zero points likewise, packed along the outputs.
    out = {"weight_packed": pack(q.codes, 1), "weight_scale": q.scale.contiguous(),
           "weight_shape": torch.tensor(list(q.codes.shape), dtype=torch.int32)}
    if not sym:
        out["weight_zero_point"] = pack(q.zero, 0)
    return out


def quant_config(fmt: str, group: int, sym: bool, desc_act: bool = False) -> dict:
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
                "desc_act": desc_act, "checkpoint_format": fmt}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group == -1 else "group",
               "group_size": None if group == -1 else group}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}


class Snapper:
    """make_reference's `prepare`: snaps every decoder linear to the grid, keeping each's
    Quantized for `write`."""

    def __init__(self, fmt: str, group: int, sym: bool, desc_act: bool = False, seed: int = 0):
        self.fmt, self.group, self.sym, self.desc_act = fmt, group, sym, desc_act
        self.gen = torch.Generator().manual_seed(seed)
        self.quantized: dict[str, Quantized] = {}

    def __call__(self, model) -> None:
        scale_dtype = torch.bfloat16 if self.fmt == "ct" else torch.float16
        for i, layer in enumerate(model.model.layers):
            orders = {}
            for name in LINEARS:
                linear = layer.get_submodule(name)
                g_idx = None
                if self.desc_act:  # GPTQ's act order: group i // size of a permuted column
                    inp = linear.weight.shape[1]
                    key = _SAME_INPUT.get(name, name)
                    if key not in orders:
                        orders[key] = torch.randperm(inp, generator=self.gen)
                    g_idx = torch.empty(inp, dtype=torch.int64)
                    g_idx[orders[key]] = torch.arange(inp) // self.group
                q = quantize(linear.weight.data, self.group, self.sym, scale_dtype, g_idx)
                linear.weight.data = q.dequantized()
                self.quantized[f"model.layers.{i}.{name}"] = q

    def write(self, folder: str) -> None:
        """The saved (dequantized) checkpoint rewritten in the format, config.json told."""
        file = os.path.join(folder, "model.safetensors")
        tensors = load_file(file)
        for module, q in self.quantized.items():
            del tensors[f"{module}.weight"]
            if self.fmt in ("gptq", "gptq_v2"):
                parts = gptq_tensors(q, v1=self.fmt == "gptq")
            elif self.fmt == "awq":
                parts = awq_tensors(q)
            else:
                parts = ct_tensors(q, self.sym)
            tensors.update({f"{module}.{k}": v for k, v in parts.items()})
        save_file(tensors, file, metadata={"format": "pt"})
        fmt = "compressed-tensors" if self.fmt == "ct" else self.fmt
        rewrite_config(folder, quantization_config=quant_config(fmt, self.group, self.sym,
                                                                 self.desc_act))


def rewrite_config(folder: str, **fields) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | fields, f)
