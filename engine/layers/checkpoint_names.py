"""What a weight loader needs of the family, as data (`CheckpointNames`, built by
engine.models.registry), and llama.cpp's per-block tensor names, the default a family's own
GGUF names override."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

# llama.cpp per-block tensor names -> HF names under model.layers.{i}.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


class CheckpointNames(msgspec.Struct, frozen=True):
    """A family's names for its checkpoint's tensors (engine.models.registry.checkpoint_names)."""

    shapes: dict[str, tuple[int, ...]]  # every tensor the model needs, by HF name
    # llama.cpp block tensor names -> HF names (the family's own over Llama's).
    gguf_layer_names: dict[str, str] = msgspec.field(default_factory=lambda: dict(GGUF_LAYER_NAMES))
    # (GGUF name -> dequantized array, GGUF name -> HF name or None) -> HF name -> array: for
    # a family whose GGUF tensors are grouped otherwise than its checkpoint's (gpt-oss).
    gguf_tensors: Callable | None = None
    # A safetensors name -> the name the model uses, or None for one it does not use; None:
    # the names are the model's own (an encoder's checkpoint prefixes them with bert.).
    rename: Callable[[str], str | None] | None = None
