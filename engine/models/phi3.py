"""Phi-3 / Phi-4: the Llama layout with q/k/v and gate/up fused in the checkpoint itself
(qkv_proj, gate_up_proj: the same row order our Llama model fuses them in), LongRoPE
("longrope", once "su") short/long rotary factors (engine.layers.rotary), and a sliding
window over every layer where the config sets one."""

from __future__ import annotations

import functools

import msgspec
import torch

from engine.layers.config import (
    HFConfig,
    LayerAttention,
    ModelConfig,
    RopeScaling,
    config_from_gguf,
    config_from_hf,
    gguf_arch_value,
    gguf_tensor_values,
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


# --- GGUF (llama.cpp's convert_hf_to_gguf.py) ---------------------------------------------------

# llama.cpp keeps Phi-3's fused projections, under these names.
GGUF_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def read_phi3_gguf(reader) -> ModelConfig:
    """head_dim is hidden / heads (rope.dimension_count is the rotary width, less than the
    head for Phi-4-mini); LongRoPE's factors are the rope_factors_short / _long tensors;
    a sliding_window of 0 means none (llama.cpp's mark for Phi-4)."""
    meta = functools.partial(gguf_arch_value, reader)
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = hidden // heads
    rotary = meta("rope.dimension_count", head_dim)
    require(0 < rotary <= head_dim and rotary % 2 == 0, "GGUF rope.dimension_count",
            f"{rotary} is not an even width within the head ({head_dim})")
    fields = dict(head_dim=head_dim, rotary_dim=None if rotary == head_dim else rotary)
    long = gguf_tensor_values(reader, "rope_factors_long.weight")
    if long is not None:
        attention_factor = meta("rope.scaling.attn_factor", None)
        fields["rope_scaling"] = RopeScaling(
            rope_type="longrope", long_factor=long,
            short_factor=gguf_tensor_values(reader, "rope_factors_short.weight"),
            original_max_position_embeddings=meta("rope.scaling.original_context_length"),
            attention_factor=None if attention_factor is None else float(attention_factor))
    window, context = meta("attention.sliding_window", 0), meta("context_length")
    if 0 < window < context:
        fields["layer_attention"] = (LayerAttention(window=window),) * meta("block_count")
    return config_from_gguf(reader, **fields)
