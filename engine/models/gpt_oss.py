"""gpt-oss: the Llama layout with biases on q/k/v/o, attention sinks (a learned logit per
head in each softmax), sliding-window layers alternating with full ones, YaRN rotary
scaling, and an MoE MLP (engine.models.moe) whose router and experts carry biases and whose
experts use a clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
g = min(gate, limit).

The checkpoint stores each projection's experts stacked as [experts, in, out], gate and up
interleaved column by column; they load as our per-expert [out, in] rows, gate rows then
up rows. The published checkpoints quantize the experts to MXFP4 (blocks of 32 FP4 values
sharing a power-of-two scale). Where the CPU kernels multiply blocks (one rank), each expert
stays MXFP4, repacked into GGUF's block of 17 bytes (the scale, then 16 bytes of codes), the
kernel's layout: 4.25 bits a weight, the checkpoint's own bytes (gpt-oss-20b's 19 billion
expert weights: about 10 GB, where bfloat16 took 38). Elsewhere they are dequantized at
load, as transformers does on a machine without its MXFP4 kernels.
"""

from __future__ import annotations

import functools

import msgspec
import numpy as np
import torch

from engine.layers.config import (
    HFConfig,
    LayerAttention,
    ModelConfig,
    MoeConfig,
    config_from_gguf,
    config_from_hf,
    gguf_arch_value,
    layer_windows,
    require,
)
from engine.layers.gguf_weights import BLOCK_KINDS, MXFP4_BLOCK, QuantizedWeight
from engine.models.llama import LlamaModel, attention_shapes
from engine.models.moe import ExpertLinear, MoeBlock


class GptOssOptions(msgspec.Struct, frozen=True):
    swiglu_alpha: float
    swiglu_limit: float
    mxfp4: bool = False  # experts stored as MXFP4 blocks and scales


# The FP4 (e2m1) values of codes 0..15.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The clamped SwiGLU's constants in every released checkpoint (and fixed in llama.cpp).
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [E, out, in / 32, 16] (bytes: low nibble first), scales [E, out, in / 32]
    (exponents biased by 127) -> float32 [E, in, out], the dense checkpoint's layout. The
    loader hands them over as floats; byte values are exact in every float dtype."""
    codes = blocks.to(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)
    values = values.reshape(*codes.shape[:-1], -1)  # [E, out, in / 32, 32]
    exponents = scales.to(torch.int32) - 127
    dense = torch.ldexp(values, exponents.unsqueeze(-1))
    return dense.reshape(*dense.shape[:2], -1).transpose(1, 2)


def mxfp4_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One expert's blocks [out, in / 32, 16] (byte j: weights 2j, 2j + 1, low nibble first)
    and scales [out, in / 32] -> GGUF MXFP4 rows, uint8 [out, in / 32 * 17]: per block the
    scale byte (the same E8M0 exponent), then byte j holding weight j (low nibble) and
    j + 16 (high), ggml's order."""
    blocks, scales = blocks.to(torch.uint8), scales.to(torch.uint8)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # weight order
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), nibbles], dim=-1).flatten(-2).contiguous()


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """x: [n, 2 * inter], gate then up -> [n, inter], as transformers' GptOssExperts."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssModel(LlamaModel):
    def _layer(self, w, i: int):
        layer = super()._layer(w, i)
        layer.o_bias = w(f"model.layers.{i}.self_attn.o_proj.bias")
        layer.sinks = w(f"model.layers.{i}.self_attn.sinks")
        return layer

    def _mlp_fields(self, w, i: int) -> dict:
        p = f"model.layers.{i}.mlp."
        if self._experts_packed():
            gate_up, down_linear = self._packed_experts(w, p)
            return self._moe_fields(w, p, gate_up, down_linear)
        stacked_gate_up = self._experts(w, p + "experts.gate_up_proj")  # [E, hidden, 2 * inter]
        gate_up_bias = w(p + "experts.gate_up_proj_bias")  # [E, 2 * inter]
        down = self._experts(w, p + "experts.down_proj")  # [E, inter, hidden]
        down_bias = w(p + "experts.down_proj_bias")
        experts = range(self.config.moe.num_experts)

        def deinterleave(t: torch.Tensor) -> torch.Tensor:  # columns g0 u0 g1 u1 ...
            return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)

        gate_up = ExpertLinear(
            [deinterleave(stacked_gate_up[e]).t().contiguous() for e in experts],
            [deinterleave(gate_up_bias[e]).contiguous() for e in experts])
        down_linear = ExpertLinear([down[e].t().contiguous() for e in experts],
                                   [down_bias[e] for e in experts])
        return self._moe_fields(w, p, gate_up, down_linear)

    def _moe_fields(self, w, p: str, gate_up: ExpertLinear, down_linear: ExpertLinear) -> dict:
        options = self.config.family_options
        activation = functools.partial(clamped_swiglu, alpha=options.swiglu_alpha,
                                       limit=options.swiglu_limit)
        block = MoeBlock(self.config.moe, w(p + "router.weight"), w(p + "router.bias"),
                         gate_up, down_linear, activation=activation)
        return dict(gate_up_weight=None, down_weight=None, moe=block)

    def _experts_packed(self) -> bool:
        """Whether the MXFP4 experts stay packed: the ops multiply blocks at every row count
        (CpuKernelOps.multiplies_blocks) on one rank (a rank's slice is dequantized)."""
        return (self.config.family_options.mxfp4 and self.device.type == "cpu"
                and not self.tp.parallel and self.ops.multiplies_blocks(self.dtype))

    def _packed_experts(self, w, p: str) -> tuple[ExpertLinear, ExpertLinear]:
        """Each expert's weights as meta tensors (no bytes) whose MXFP4 blocks the ops hold:
        gate_up's rows (the checkpoint's blocks are out-major, gate and up interleaved) go
        gate then up, as the dense path's columns do."""
        moe, hidden = self.config.moe, self.config.hidden_size
        names = p + "experts.gate_up_proj", p + "experts.down_proj"
        (gu_blocks, gu_scales), (d_blocks, d_scales) = (
            (w(n + "_blocks"), w(n + "_scales")) for n in names)
        gate_up_bias, down_bias = w(names[0] + "_bias"), w(names[1] + "_bias")
        gate_ups, downs = [], []
        for e in range(moe.num_experts):
            rows = torch.cat([gu_blocks[e, 0::2], gu_blocks[e, 1::2]])
            scales = torch.cat([gu_scales[e, 0::2], gu_scales[e, 1::2]])
            gate_ups.append(self._held(mxfp4_gguf_blocks(rows, scales), hidden))
            downs.append(self._held(mxfp4_gguf_blocks(d_blocks[e], d_scales[e]),
                                    moe.intermediate_size))
        bias = [torch.cat([b[0::2], b[1::2]]) for b in gate_up_bias]
        return ExpertLinear(gate_ups, bias), ExpertLinear(downs, list(down_bias))

    def _held(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """A meta weight [out, width] standing for GGUF MXFP4 `rows`, handed to the ops
        (LlamaModel refuses to start where they did not take them)."""
        weight = torch.empty((rows.shape[0], width), dtype=self.dtype, device="meta")
        self.ops.attach_quantized(weight, [QuantizedWeight(BLOCK_KINDS["MXFP4"], rows)])
        return weight

    def _attach_quantized(self, quantized) -> None:
        """Besides the dense linears', each expert's blocks (a GGUF's MXFP4 ffn_*_exps:
        the file splits gate and up, so gate then up rows, the order _mlp_fields puts them
        in), for the ops to multiply the expert's rows by."""
        super()._attach_quantized(quantized)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}.mlp.experts."
            experts = zip(layer.moe.gate_up.weights, layer.moe.down.weights, strict=True)
            for e, (gate_up, down) in enumerate(experts):
                self._attach(gate_up, [quantized.get(f"{p}{e}.{n}.weight")
                                       for n in ("gate_proj", "up_proj")])
                self._attach(down, [quantized.get(f"{p}{e}.down_proj.weight")])

    def _experts(self, w, name: str) -> torch.Tensor:
        if not self.config.family_options.mxfp4:
            return w(name)
        dense = dequantize_mxfp4(w(name + "_blocks"), w(name + "_scales"))
        return dense.to(dtype=self.dtype, device=self.device)


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, moe = config.hidden_size, config.moe
    experts, inter = moe.num_experts, moe.intermediate_size
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    layer = attention_shapes(config) | {
        "self_attn.o_proj.bias": (hidden,),
        "self_attn.sinks": (config.num_heads,),
        "mlp.router.weight": (experts, hidden),
        "mlp.router.bias": (experts,),
        "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
        "mlp.experts.down_proj_bias": (experts, hidden),
    }
    if config.family_options.mxfp4:
        for name, (rows, width) in {"gate_up_proj": (2 * inter, hidden),
                                    "down_proj": (hidden, inter)}.items():
            groups = width // MXFP4_BLOCK
            layer[f"mlp.experts.{name}_blocks"] = (experts, rows, groups, MXFP4_BLOCK // 2)
            layer[f"mlp.experts.{name}_scales"] = (experts, rows, groups)
    else:
        layer["mlp.experts.gate_up_proj"] = (experts, hidden, 2 * inter)
        layer["mlp.experts.down_proj"] = (experts, inter, hidden)
    for i in range(config.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


class _GptOssHF(HFConfig):
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT
    quantization_config: dict | None = None


def read_gpt_oss_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_GptOssHF)
    method = (hf.quantization_config or {}).get("quant_method")
    require(method in (None, "mxfp4"), "quantization_config",
            f"quant_method {method!r} is not implemented (only mxfp4)")
    mxfp4 = method == "mxfp4"
    for key, width in (("hidden_size", hf.hidden_size),
                       ("intermediate_size", hf.intermediate_size)):
        require(not mxfp4 or width % MXFP4_BLOCK == 0, key,
                f"{width} is not a multiple of MXFP4's {MXFP4_BLOCK}-value blocks")
    require(0 < hf.num_experts_per_tok <= hf.num_local_experts, "num_experts_per_tok",
            f"{hf.num_experts_per_tok} is not within 1..{hf.num_local_experts}")
    max_positions = hf.max_position_embeddings or 131072
    if hf.layer_types is None:  # transformers' default: even layers slide
        hf.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                          for i in range(hf.num_hidden_layers)]
    windows = layer_windows(hf, max_positions)
    moe = MoeConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.intermediate_size, routing="topk_softmax",
                    router_bias=True, expert_bias=True)
    return config_from_hf(
        hf, "gpt_oss", max_positions, attention_bias=True, moe=moe,
        layer_attention=tuple(LayerAttention(window=w, sinks=True) for w in windows),
        family_options=GptOssOptions(hf.swiglu_alpha, hf.swiglu_limit, mxfp4))


# --- GGUF (llama.cpp's convert_hf_to_gguf.py, general.architecture "gpt-oss") --------------------

GGUF_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
}
_GGUF_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def read_gpt_oss_gguf(reader) -> ModelConfig:
    """llama.cpp's gpt-oss: every other layer windowed from the first (its pattern of 2, as
    transformers' default), sinks in every layer, biases everywhere. What the file does not
    store is the checkpoints' own: the clamped SwiGLU's alpha and limit (llama.cpp fixes them
    too), and YaRN's ramp untruncated ("truncate": false). Experts load dequantized, whatever
    block type (MXFP4 in the converter's files) they are stored in."""
    meta = functools.partial(gguf_arch_value, reader)
    layers, context = meta("block_count"), meta("context_length")
    window = meta("attention.sliding_window")
    require(0 < window <= context, "GGUF attention.sliding_window",
            f"{window} is not a window within the context (1..{context})")
    attention = tuple(LayerAttention(window=None if i % 2 else window, sinks=True)
                      for i in range(layers))
    moe = MoeConfig(num_experts=meta("expert_count"), top_k=meta("expert_used_count"),
                    intermediate_size=meta("expert_feed_forward_length"),
                    routing="topk_softmax", router_bias=True, expert_bias=True)
    options = GptOssOptions(SWIGLU_ALPHA, SWIGLU_LIMIT)
    config = config_from_gguf(reader, architecture="gpt_oss", attention_bias=True, moe=moe,
                              layer_attention=attention, family_options=options)
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn":
        scaling = msgspec.structs.replace(config.rope_scaling, truncate=False)
        config = msgspec.structs.replace(config, rope_scaling=scaling)
    return config


def gguf_tensors(arrays: dict[str, np.ndarray], hf_name) -> dict[str, np.ndarray]:
    """A gpt-oss GGUF's tensors (dequantized, numpy's dimension order) under the checkpoint's
    names. The converter splits each layer's interleaved gate_up experts into gate and up and
    stores every expert projection as [E, out, in]; they go back to the checkpoint's stacked
    [E, in, out], gate and up interleaved column by column."""
    named, experts = {}, {}
    for name, array in arrays.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:
            experts[(parts[1], parts[2], parts[3])] = array
            continue
        hf = hf_name(name)
        if hf is None:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        named[hf.removesuffix(".weight") if hf.endswith(".sinks.weight") else hf] = array
    for layer in sorted({key[0] for key in experts}):
        p = f"model.layers.{layer}.mlp.experts."
        gate, up, down = (experts.pop((layer, proj, "weight"), None) for proj in _GGUF_EXPERTS)
        gate_b, up_b, down_b = (experts.pop((layer, proj, "bias"), None)
                                for proj in _GGUF_EXPERTS)
        if gate is not None and up is not None:  # else the loader names what is missing
            named[p + "gate_up_proj"] = _interleave(gate.swapaxes(1, 2), up.swapaxes(1, 2))
        if gate_b is not None and up_b is not None:
            named[p + "gate_up_proj_bias"] = _interleave(gate_b, up_b)
        if down is not None:
            named[p + "down_proj"] = np.ascontiguousarray(down.swapaxes(1, 2))
        if down_b is not None:
            named[p + "down_proj_bias"] = down_b
    if experts:
        layer, proj, suffix = sorted(experts)[0]
        raise ValueError(f"unexpected GGUF tensor 'blk.{layer}.{proj}.{suffix}'")
    return named


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[..., n] and [..., n] -> [..., 2n]: g0 u0 g1 u1 ..., the checkpoint's gate_up columns."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)
