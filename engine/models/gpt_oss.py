"""gpt-oss: the Llama layout with biases on q/k/v/o, attention sinks (a learned logit per
head in each softmax), sliding-window layers alternating with full ones, YaRN rotary
scaling, and an MoE MLP (engine.models.moe) whose router and experts carry biases and whose
experts use a clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), with
g = min(gate, limit).

The checkpoint stores each projection's experts stacked as [experts, in, out], gate and up
interleaved column by column; they load as our per-expert [out, in] rows, gate rows then
up rows. MXFP4-quantized expert weights (the published checkpoints) are refused for now.
"""

from __future__ import annotations

import functools

import msgspec
import torch

from engine.models.config import (
    HFConfig,
    LayerAttention,
    ModelConfig,
    MoeConfig,
    config_from_hf,
    layer_windows,
    require,
)
from engine.models.llama import LlamaModel, attention_shapes
from engine.models.moe import ExpertLinear, MoeBlock


class GptOssOptions(msgspec.Struct, frozen=True):
    swiglu_alpha: float
    swiglu_limit: float


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
        stacked_gate_up = w(p + "experts.gate_up_proj")  # [E, hidden, 2 * inter]
        gate_up_bias = w(p + "experts.gate_up_proj_bias")  # [E, 2 * inter]
        down = w(p + "experts.down_proj")  # [E, inter, hidden]
        down_bias = w(p + "experts.down_proj_bias")
        experts = range(self.config.moe.num_experts)

        def deinterleave(t: torch.Tensor) -> torch.Tensor:  # columns g0 u0 g1 u1 ...
            return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)

        gate_up = ExpertLinear(
            [deinterleave(stacked_gate_up[e]).t().contiguous() for e in experts],
            [deinterleave(gate_up_bias[e]).contiguous() for e in experts])
        down_linear = ExpertLinear([down[e].t().contiguous() for e in experts],
                                   [down_bias[e] for e in experts])
        options = self.config.family_options
        activation = functools.partial(clamped_swiglu, alpha=options.swiglu_alpha,
                                       limit=options.swiglu_limit)
        block = MoeBlock(self.config.moe, w(p + "router.weight"), w(p + "router.bias"),
                         gate_up, down_linear, activation=activation)
        return dict(gate_up_weight=None, down_weight=None, moe=block)


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
        "mlp.experts.gate_up_proj": (experts, hidden, 2 * inter),
        "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
        "mlp.experts.down_proj": (experts, inter, hidden),
        "mlp.experts.down_proj_bias": (experts, hidden),
    }
    for i in range(config.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


class _GptOssHF(HFConfig):
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    quantization_config: dict | None = None


def read_gpt_oss_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_GptOssHF)
    require(hf.quantization_config is None, "quantization_config",
            "quantized (MXFP4) gpt-oss experts are not implemented; dequantize the "
            "checkpoint to bfloat16 first")
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
        family_options=GptOssOptions(hf.swiglu_alpha, hf.swiglu_limit))
