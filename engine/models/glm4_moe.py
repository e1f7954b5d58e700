"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): the Llama layout with q/k/v biases, optional
per-head q/k norms, rotary over part of each head (partial_rotary_factor, 0.5 in the
released models), plain dense MLPs in the first `first_k_dense_replace` layers and MoE MLPs
after them, each with an always-on (ungated) shared expert.

The router is DeepSeek-V3's: sigmoid scores; the experts are chosen on the scores plus a
learned per-expert correction bias (e_score_correction_bias), only within the `topk_group`
best of `n_group` expert groups (a group scored by its two best experts); the chosen
experts' weights are their plain scores, renormalised where norm_topk_prob says, then scaled
by routed_scaling_factor. Computed in float32, as transformers keeps the router.

The checkpoints carry multi-token-prediction layers past num_hidden_layers
(num_nextn_predict_layers), which transformers ignores for generation; so does this.
"""

from __future__ import annotations

import functools

import msgspec
import torch
import torch.nn.functional as F

from engine.layers.config import (
    HFConfig,
    ModelConfig,
    MoeConfig,
    config_from_gguf,
    config_from_hf,
    gguf_arch_value,
    require,
)
from engine.models.llama import mlp_shapes
from engine.models.moe import (
    ExpertLinear,
    MoeBlock,
    MoeModel,
    expert_gate_up,
    group_limited_top_k,
    layered_moe_shapes,
)


class GroupedRouting(msgspec.Struct, frozen=True):
    """The group-limited sigmoid router's settings (family_options)."""

    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0


class GroupedSigmoidMoeBlock(MoeBlock):
    """MoeBlock with the group-limited sigmoid router (see the module's docstring)."""

    def __init__(self, config: MoeConfig, routing: GroupedRouting, router: torch.Tensor,
                 score_bias: torch.Tensor, gate_up, down, shared) -> None:
        super().__init__(config, router.float(), None, gate_up, down, shared=shared)
        self.routing = routing
        self.score_bias = score_bias.float()

    def route(self, x: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        c, r = self.config, self.routing
        linear = ops.linear if ops is not None else F.linear
        scores = torch.sigmoid(linear(x.float(), self.router))
        experts, weights = group_limited_top_k(
            scores, scores + self.score_bias, r.num_groups, r.topk_groups, c.top_k,
            c.norm_topk_prob, r.routed_scaling_factor)
        return experts, weights.to(x.dtype)


class Glm4MoeModel(MoeModel):
    def _mlp_fields(self, w, i: int) -> dict:
        moe = self.config.moe
        if i in moe.dense_layers:
            return super(MoeModel, self)._mlp_fields(w, i)
        p = f"model.layers.{i}.mlp."

        def expert(e: int, proj: str) -> torch.Tensor:
            return w(f"{p}experts.{e}.{proj}.weight")

        experts = range(moe.num_experts)
        gate_up = ExpertLinear([expert_gate_up(expert(e, "gate_proj"), expert(e, "up_proj"))
                                for e in experts])
        down = ExpertLinear([expert(e, "down_proj") for e in experts])
        s = p + "shared_experts."
        shared = (torch.cat([w(s + "gate_proj.weight"), w(s + "up_proj.weight")]),
                  w(s + "down_proj.weight"), None)  # no gate: always added whole
        block = GroupedSigmoidMoeBlock(moe, self.config.family_options, w(p + "gate.weight"),
                                       w(p + "gate.e_score_correction_bias"), gate_up, down,
                                       shared)
        return dict(gate_up_weight=None, down_weight=None, moe=block)


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    moe, hidden = config.moe, config.hidden_size
    layer = {"mlp.gate.weight": (moe.num_experts, hidden),
             "mlp.gate.e_score_correction_bias": (moe.num_experts,)}
    for e in range(moe.num_experts):
        layer |= mlp_shapes(config, f"mlp.experts.{e}.", moe.intermediate_size)
    layer |= mlp_shapes(config, "mlp.shared_experts.", moe.shared_expert_intermediate_size)
    return layered_moe_shapes(config, layer)


def checkpoint_names(config: ModelConfig):
    """The multi-token-prediction layers (model.layers.{num_layers + j}) are not served."""
    def rename(name: str) -> str | None:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= config.num_layers:
            return None
        return name

    return rename


class _Glm4MoeHF(HFConfig):
    n_routed_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1408
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    use_qk_norm: bool = False
    topk_method: str = "noaux_tc"


def read_glm4_moe_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_Glm4MoeHF)
    require(hf.hidden_act == "silu", "hidden_act",
            f"{hf.hidden_act!r} is not implemented (only silu)")
    require(hf.topk_method == "noaux_tc", "topk_method",
            f"{hf.topk_method!r} is not implemented (only noaux_tc)")
    experts, groups = hf.n_routed_experts, hf.n_group
    require(0 < hf.num_experts_per_tok <= experts, "num_experts_per_tok",
            f"{hf.num_experts_per_tok} is not within 1..{experts}")
    require(groups > 0 and experts % groups == 0 and (groups == 1 or experts // groups >= 2),
            "n_group", f"{groups} does not split {experts} experts into groups of 2 or more")
    require(0 < hf.topk_group <= groups, "topk_group", f"{hf.topk_group} is not within "
            f"1..{groups}")
    require(hf.n_shared_experts > 0, "n_shared_experts", "GLM-4.5 needs its shared expert")
    require(0 <= hf.first_k_dense_replace <= hf.num_hidden_layers, "first_k_dense_replace",
            f"{hf.first_k_dense_replace} is not within 0..{hf.num_hidden_layers}")
    # transformers' default where the config names no partial rotary factor: half the head.
    if hf.partial_rotary_factor is None and "partial_rotary_factor" not in (
            hf.rope_parameters or hf.rope_scaling or {}):
        hf.partial_rotary_factor = 0.5
    moe = MoeConfig(num_experts=experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.moe_intermediate_size, routing="sigmoid_grouped",
                    norm_topk_prob=hf.norm_topk_prob,
                    shared_expert_intermediate_size=hf.moe_intermediate_size
                    * hf.n_shared_experts,
                    dense_layers=tuple(range(hf.first_k_dense_replace)))
    routing = GroupedRouting(groups, hf.topk_group, hf.routed_scaling_factor)
    return config_from_hf(hf, "glm4_moe", 131072, moe=moe, attention_bias=hf.attention_bias,
                          qk_norm=hf.use_qk_norm, family_options=routing)


# --- GGUF (llama.cpp's convert_hf_to_gguf.py, general.architecture "glm4moe") ------------------

GGUF_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "exp_probs_b": "mlp.gate.e_score_correction",  # + ".bias": the correction bias
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def read_glm4_moe_gguf(reader) -> ModelConfig:
    """llama.cpp's glm4moe: the rotary width is rope.dimension_count, q/k norms where the
    file holds them, the leading dense layers (leading_dense_block_count) and the router's
    settings (expert_weights_norm / _scale, expert_group_count / _used_count, 1 where
    absent); the nextn (MTP) blocks the file counts in block_count are not served."""
    meta = functools.partial(gguf_arch_value, reader)
    require(meta("expert_gating_func", _SIGMOID) == _SIGMOID, "GGUF expert_gating_func",
            "only sigmoid (2) is implemented for glm4moe")
    names = {t.name for t in reader.tensors}
    layers = meta("block_count") - meta("nextn_predict_layers", 0)
    head_dim = meta("attention.key_length")
    rotary = meta("rope.dimension_count", head_dim)
    moe = MoeConfig(num_experts=meta("expert_count"), top_k=meta("expert_used_count"),
                    intermediate_size=meta("expert_feed_forward_length"),
                    routing="sigmoid_grouped", norm_topk_prob=bool(meta("expert_weights_norm",
                                                                        True)),
                    shared_expert_intermediate_size=meta("expert_feed_forward_length")
                    * meta("expert_shared_count", 1),
                    dense_layers=tuple(range(meta("leading_dense_block_count", 1))))
    routing = GroupedRouting(meta("expert_group_count", 1), meta("expert_group_used_count", 1),
                             float(meta("expert_weights_scale", 1.0)))
    return config_from_gguf(
        reader, architecture="glm4_moe", num_layers=layers, head_dim=head_dim,
        rotary_dim=rotary if rotary != head_dim else None, moe=moe, family_options=routing,
        attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names)


_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}


def gguf_tensors(arrays: dict, hf_name) -> dict:
    """A glm4moe GGUF's tensors under the checkpoint's names: each stacked expert
    projection [E, out, in] split per expert, the correction bias (exp_probs_b.bias) under
    its checkpoint name, and the nextn (MTP) blocks, told by their nextn.* tensors, left out."""
    mtp = {name.split(".")[1] for name in arrays if ".nextn." in name}
    named = {}
    for name, array in arrays.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[1] in mtp:
            continue
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:
            proj = _GGUF_EXPERTS[parts[2]]
            for e in range(array.shape[0]):
                named[f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{parts[3]}"] = array[e]
            continue
        hf = hf_name(name)
        if hf is None:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        named[hf.replace("e_score_correction.bias", "e_score_correction_bias")] = array
    return named
