"""llama.cpp's `deepseek2` GGUF files (DeepSeek-V2, V3 / R1) as engine.models.deepseek
serves them: the metadata into its ModelConfig, the tensors under the checkpoint's names.

convert_hf_to_gguf.py writes MLA as multi-query attention (head_count_kv 1, key_length
kv_lora_rank + rope, value_length kv_lora_rank; the per-head widths in key_length_mla and
value_length_mla), and splits kv_b_proj into attn_k_b ([heads, kv_lora_rank, nope], each
head's key half transposed) and attn_v_b ([heads, v, kv_lora_rank]); older files keep one
attn_kv_b. Rotary rows are stored as the checkpoint's (llama.cpp's "norm" rope is the
same interleaved pairs). What the file does not store is taken as DeepSeek's released
configs have it: YaRN's mscale equal to its mscale_all_dim (the cos/sin scale is then 1).
"""

from __future__ import annotations

import functools
import math

import msgspec
import numpy as np

from engine.layers.config import (
    MlaConfig,
    ModelConfig,
    MoeConfig,
    config_from_gguf,
    gguf_arch_value,
)
from engine.models.deepseek import DeepseekOptions, DeepseekRouting

# llama.cpp block names -> HF names, where they differ from Llama's (checkpoint_names).
GGUF_LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


def read_deepseek2_gguf(reader) -> ModelConfig:
    meta = functools.partial(gguf_arch_value, reader)
    heads, rope = meta("attention.head_count"), meta("rope.dimension_count")
    # Files from before the MLA split store the per-head widths in key/value_length.
    qk = meta("attention.key_length_mla", None) or meta("attention.key_length")
    v_dim = meta("attention.value_length_mla", None) or meta("attention.value_length")
    gating = _GATING.get(meta("expert_gating_func", 1))
    _check(gating is not None, "expert_gating_func",
           f"{meta('expert_gating_func', 1)} is neither softmax (1) nor sigmoid (2)")
    v3 = gating == "sigmoid"
    experts, groups = meta("expert_count"), meta("expert_group_count", 1) or 1
    names = {t.name for t in reader.tensors}
    routing = DeepseekRouting(gating, groups, meta("expert_group_used_count", groups) or groups,
                              "top2_sum" if v3 else "max",
                              float(meta("expert_weights_scale", 1.0)),
                              any(n.endswith("exp_probs_b.bias") for n in names))
    _check(experts % groups == 0, "expert_group_count",
           f"{groups} groups do not divide {experts} experts")
    dense = tuple(range(meta("leading_dense_block_count", 0)))
    shared = meta("expert_shared_count", 0) * meta("expert_feed_forward_length")
    moe = MoeConfig(num_experts=experts, top_k=meta("expert_used_count"),
                    intermediate_size=meta("expert_feed_forward_length"),
                    norm_topk_prob=bool(meta("expert_weights_norm", False)) and v3,
                    shared_expert_intermediate_size=shared, dense_layers=dense)
    config = config_from_gguf(reader, architecture="deepseek_v3" if v3 else "deepseek_v2",
                              num_kv_heads=heads, head_dim=qk, rotary_dim=rope, moe=moe,
                              family_options=DeepseekOptions(routing, rope_interleave=True))
    scaling, scale = config.rope_scaling, qk ** -0.5
    if scaling is not None and scaling.rope_type == "yarn":
        # yarn_log_multiplier is 0.1 * mscale_all_dim (the converter's), stored as float32:
        # rounded back to the config's value (0.707, 1.0).
        all_dim = round(float(meta("rope.scaling.yarn_log_multiplier", 0.0)) * 10, 6)
        if all_dim:
            scale *= (0.1 * all_dim * math.log(scaling.factor) + 1.0) ** 2
            scaling = msgspec.structs.replace(scaling, mscale=all_dim, mscale_all_dim=all_dim)
    q_lora = meta("attention.q_lora_rank", 0) or None
    mla = MlaConfig(kv_lora_rank=meta("attention.kv_lora_rank"), qk_nope_head_dim=qk - rope,
                    qk_rope_head_dim=rope, v_head_dim=v_dim, q_lora_rank=q_lora,
                    softmax_scale=scale)
    return msgspec.structs.replace(config, mla=mla, rope_scaling=scaling)


def _check(condition: bool, key: str, why: str) -> None:
    if not condition:
        raise ValueError(f"GGUF deepseek2.{key}: {why}")


def gguf_tensors(arrays: dict[str, np.ndarray], hf_name) -> dict[str, np.ndarray]:
    """The file's tensors (dequantized, numpy's order) under the checkpoint's names: each
    stacked expert tensor [E, out, in] as E experts, attn_k_b + attn_v_b as one kv_b_proj,
    exp_probs_b.bias as the router's e_score_correction_bias."""
    named, halves = {}, {}
    for name, array in arrays.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERTS:
            p = f"model.layers.{parts[1]}.mlp.experts."
            named.update({f"{p}{e}.{_EXPERTS[parts[2]]}.weight": array[e]
                          for e in range(array.shape[0])})
        elif len(parts) == 4 and parts[2] in ("attn_k_b", "attn_v_b"):
            halves[(parts[1], parts[2])] = array
        elif len(parts) == 4 and parts[2] == "exp_probs_b":
            named[f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias"] = array
        else:
            hf = hf_name(name)
            if hf is None:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            named[hf] = array
    for layer in sorted({key[0] for key in halves}):
        k_b, v_b = halves.pop((layer, "attn_k_b"), None), halves.pop((layer, "attn_v_b"), None)
        if k_b is None or v_b is None:
            raise ValueError(f"GGUF block {layer} has only one of attn_k_b and attn_v_b")
        kv_b = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)  # [heads, nope + v, lora]
        named[f"model.layers.{layer}.self_attn.kv_b_proj.weight"] = kv_b.reshape(
            -1, kv_b.shape[-1])
    return named
