"""Phi-3 / Phi-4: the Llama layout with q/k/v and gate/up fused in the checkpoint itself
(qkv_proj, gate_up_proj: the same row order our Llama model fuses them in), LongRoPE
("longrope", once "su") short/long rotary factors (engine.models.rotary), and a sliding
window over every layer where the config sets one."""

from __future__ import annotations

import msgspec
import torch

from engine.models.config import (
    HFConfig,
    ModelConfig,
    config_from_hf,
    require,
    whole_model_window,
)
from engine.models.llama import LlamaModel


class Phi3Model(LlamaModel):
    def _qkv_weight(self, w, attn: str) -> torch.Tensor:
        return w(attn + "qkv_proj.weight")

    def _mlp_fields(self, w, i: int) -> dict:
        mlp = f"model.layers.{i}.mlp."
        return dict(gate_up_weight=w(mlp + "gate_up_proj.weight"),
                    down_weight=w(mlp + "down_proj.weight"))


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    layer = {
        "input_layernorm.weight": (hidden,),
        "self_attn.qkv_proj.weight": (q_out + 2 * kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_up_proj.weight": (2 * inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    for i in range(config.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


class _Phi3HF(HFConfig):
    original_max_position_embeddings: int | None = None


def read_phi3_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_Phi3HF)
    require(hf.hidden_act == "silu", "hidden_act",
            f"{hf.hidden_act!r} is not implemented (only silu)")
    require(not hf.attention_bias, "attention_bias", "not implemented for Phi-3")
    max_positions = hf.max_position_embeddings or 4096
    # LongRoPE's original length is the top-level key where there is one (transformers'
    # Phi3Config overrides the rotary parameters' copy with it).
    params = dict(hf.rope_parameters or hf.rope_scaling or {})
    if params and hf.original_max_position_embeddings:
        params["original_max_position_embeddings"] = hf.original_max_position_embeddings
        hf.rope_parameters, hf.rope_scaling = params, None
    return config_from_hf(hf, "phi3", max_positions,
                          layer_attention=whole_model_window(hf, max_positions))
