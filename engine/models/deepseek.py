"""DeepSeek-V3 / R1 (and DeepSeek-V2): multi-head latent attention (MLA) and DeepSeekMoE,
as transformers' deepseek_v3 / deepseek_v2 compute them.

Attention: q from a low-rank projection (q_a, its norm, q_b) or one q_proj; keys and values
from one latent per token (kv_a_proj_with_mqa: kv_lora_rank numbers, normed, plus a rotary
key part shared by all heads). The cache holds the latent and the rotated key part only
(engine.attention.mla_backend); kv_b_proj's key and value halves are absorbed into the query
and the output instead of up-projecting every cached token: q_nope @ W_UK scores against the
latent directly, and the attention-weighted latent @ W_UV gives each head's value.

DeepSeek lays each head's rotary dims out in interleaved pairs; the rows of q_b_proj and
kv_a_proj_with_mqa that make them are permuted once at load (evens, then odds), so the
shared half-rotation (engine.layers.rotary) gives transformers' numbers exactly.

MLP: the first first_k_dense_replace layers dense, the rest routed experts plus always-on
shared experts. Routing (DeepseekRouting): sigmoid (V3) or softmax (V2) scores; V3 adds
e_score_correction_bias for the choice only, keeps the topk_group groups with the best
sum of their two best experts, then the top-k experts there, weights renormalised and
times routed_scaling_factor; V2 limits groups by their best expert (group_limited_greedy).
"""

from __future__ import annotations

import math

import msgspec
import torch
import torch.nn.functional as F

from engine.layers.config import (
    HFConfig,
    MlaConfig,
    ModelConfig,
    MoeConfig,
    config_from_hf,
    hf_rope_parameters,
    require,
)
from engine.models.llama import LlamaModel, mlp_shapes
from engine.models.moe import (
    ExpertLinear,
    MoeBlock,
    expert_gate_up,
    group_limited_top_k,
    layered_moe_shapes,
)


class DeepseekRouting(msgspec.Struct, frozen=True):
    scoring: str  # "sigmoid" (V3) | "softmax" (V2)
    n_group: int  # 1: no group limit
    topk_group: int
    group_score: str  # "top2_sum" (V3) | "max" (V2)
    routed_scaling_factor: float
    correction_bias: bool  # V3's e_score_correction_bias


class MlaLayer(msgspec.Struct):
    input_norm: torch.Tensor
    qkv_a_weight: torch.Tensor  # q_a (when q is low-rank) and kv_a fused: one matmul
    q_a_norm: torch.Tensor | None
    q_b_weight: torch.Tensor  # q_b_proj, or q_proj when q is not low-rank
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # [heads, qk_nope_head_dim, kv_lora_rank]: kv_b's key half
    w_uv: torch.Tensor  # [heads, v_head_dim, kv_lora_rank]: kv_b's value half
    o_weight: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up_weight: torch.Tensor | None
    down_weight: torch.Tensor | None
    moe: object | None = None


# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps, not the
# config's rms_norm_eps (DeepSeek's released configs set both to 1e-6).
_LATENT_NORM_EPS = 1e-6
_LINEAR = ("qkv_a_weight", "q_b_weight", "o_weight", "gate_up_weight", "down_weight")


class DeepseekMoeBlock(MoeBlock):
    """MoeBlock's experts with DeepSeek's router and ungated shared experts."""

    def __init__(self, config: MoeConfig, routing: DeepseekRouting, router, bias,
                 gate_up: ExpertLinear, down: ExpertLinear, shared) -> None:
        super().__init__(config, router.float(), None, gate_up, down)
        self.routing = routing
        self.bias = bias.float() if bias is not None else None
        self.shared_mlp = shared  # (gate_up, down) or None

    def linear_weights(self) -> list[torch.Tensor]:
        return super().linear_weights() + list(self.shared_mlp or ())

    def route(self, x: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """As transformers' router: in float32, whatever the model's dtype."""
        c, r = self.config, self.routing
        logits = F.linear(x.float(), self.router)
        scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.bias if self.bias is not None else scores
        experts, weights = group_limited_top_k(
            scores, choice, r.n_group, r.topk_group, c.top_k, c.norm_topk_prob,
            r.routed_scaling_factor, r.group_score)
        return experts, weights.to(x.dtype)

    def __call__(self, x: torch.Tensor, ops) -> torch.Tensor:
        out = super().__call__(x, ops)
        if self.shared_mlp is not None:
            gate_up, down = self.shared_mlp
            out = out + ops.linear(ops.silu_and_mul(ops.linear(x, gate_up)), down)
        return out


def _deinterleave(rope_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


class DeepseekModel(LlamaModel):
    """LlamaModel's loop (embedding, norms, residuals, MLP dispatch, logits) with MLA
    attention; attends through engine.attention.mla_backend's `attend_latent`."""

    def _layer(self, w, i: int) -> MlaLayer:
        c, mla = self.config, self.config.mla
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        heads, nope, rope = c.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        interleaved = getattr(c.family_options, "rope_interleave", True)
        perm = _deinterleave(rope) if interleaved else torch.arange(rope)
        q_name = "q_b_proj" if mla.q_lora_rank else "q_proj"
        q_b = w(attn + f"{q_name}.weight").view(heads, nope + rope, -1)
        q_b = torch.cat([q_b[:, :nope], q_b[:, nope:][:, perm]], dim=1).reshape(
            heads * (nope + rope), -1)
        kv_a = w(attn + "kv_a_proj_with_mqa.weight")
        kv_a = torch.cat([kv_a[: mla.kv_lora_rank], kv_a[mla.kv_lora_rank:][perm]])
        qkv_a = torch.cat([w(attn + "q_a_proj.weight"), kv_a]) if mla.q_lora_rank else kv_a
        kv_b = w(attn + "kv_b_proj.weight").view(heads, nope + mla.v_head_dim, -1)
        return MlaLayer(
            input_norm=w(p + "input_layernorm.weight"),
            qkv_a_weight=qkv_a,
            q_a_norm=w(attn + "q_a_layernorm.weight") if mla.q_lora_rank else None,
            q_b_weight=q_b,
            kv_a_norm=w(attn + "kv_a_layernorm.weight"),
            w_uk=kv_b[:, :nope].contiguous(),
            w_uv=kv_b[:, nope:].contiguous(),
            o_weight=w(attn + "o_proj.weight"),
            post_attention_norm=w(p + "post_attention_layernorm.weight"),
            **self._mlp_fields(w, i),
        )

    def _mlp_fields(self, w, i: int) -> dict:
        moe = self.config.moe
        if i in moe.dense_layers:
            return super()._mlp_fields(w, i)
        p = f"model.layers.{i}.mlp."
        experts = range(moe.num_experts)
        gate_up = ExpertLinear([expert_gate_up(w(f"{p}experts.{e}.gate_proj.weight"),
                                               w(f"{p}experts.{e}.up_proj.weight"))
                                for e in experts])
        down = ExpertLinear([w(f"{p}experts.{e}.down_proj.weight") for e in experts])
        shared = None
        if moe.shared_expert_intermediate_size:
            s = p + "shared_experts."
            shared = (torch.cat([w(s + "gate_proj.weight"), w(s + "up_proj.weight")]),
                      w(s + "down_proj.weight"))
        routing = self.config.family_options.routing
        bias = w(p + "gate.e_score_correction_bias") if routing.correction_bias else None
        block = DeepseekMoeBlock(moe, routing, w(p + "gate.weight"), bias, gate_up, down,
                                 shared)
        return dict(gate_up_weight=None, down_weight=None, moe=block)

    def _store_linear_weights(self) -> None:
        for layer in self.layers:
            for name in _LINEAR:
                weight = getattr(layer, name)
                if weight is not None:
                    setattr(layer, name, self.ops.stored_weight(weight))
        self.lm_head = self.ops.stored_weight(self.lm_head)

    def _linear_weights(self) -> list[torch.Tensor]:
        dense = [getattr(layer, n) for layer in self.layers for n in _LINEAR]
        experts = [w for layer in self.layers if layer.moe for w in layer.moe.linear_weights()]
        return [w for w in dense if w is not None] + experts + [self.lm_head]

    def _attach_quantized(self, quantized) -> None:
        """A GGUF's experts stored in a kind the CPU kernels take: the ops multiply by their
        blocks (MoeModel's way); every other weight here is dequantized."""
        for i, layer in enumerate(self.layers):
            if layer.moe is None:
                continue
            p = f"model.layers.{i}.mlp.experts."
            experts = zip(layer.moe.gate_up.weights, layer.moe.down.weights, strict=True)
            for e, (gate_up, down) in enumerate(experts):
                found = [quantized.get(f"{p}{e}.{n}.weight") for n in ("gate_proj", "up_proj")]
                if isinstance(gate_up, tuple):  # a mapped pair: one weight each
                    self._attach(gate_up[0], found[:1])
                    self._attach(gate_up[1], found[1:])
                else:
                    self._attach(gate_up, found)
                self._attach(down, [quantized.get(f"{p}{e}.down_proj.weight")])

    def _fused_blocks(self, x, backend) -> None:
        return None  # the CPU kernels' fused decode layer is plain attention's

    def _attention(self, index, layer: MlaLayer, x, rope_at, backend, meta) -> torch.Tensor:
        c, mla = self.config, self.config.mla
        lora, nope, rope_dim = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        a = self.ops.linear(x, layer.qkv_a_weight)
        if mla.q_lora_rank:
            q_a, kv_a = a.split([mla.q_lora_rank, lora + rope_dim], dim=-1)
            q_in = self.ops.rms_norm(q_a.contiguous(), layer.q_a_norm, _LATENT_NORM_EPS)
        else:
            q_in, kv_a = x, a
        q = self.ops.linear(q_in, layer.q_b_weight).view(-1, c.num_heads, nope + rope_dim)
        q_nope, q_pe = q.split([nope, rope_dim], dim=-1)
        latent = self.ops.rms_norm(kv_a[:, :lora].contiguous(), layer.kv_a_norm,
                                   _LATENT_NORM_EPS)
        k_pe = kv_a[:, lora:].unsqueeze(1)
        rope, positions, tables = rope_at
        q_pe, k_pe = self.ops.rope(rope, q_pe.contiguous(), k_pe.contiguous(), positions, tables)
        # Absorbed: each head's nope query in latent space, beside its rotary part.
        q_latent = torch.einsum("thn,hnl->thl", q_nope, layer.w_uk)
        query = torch.cat([q_latent, q_pe], dim=-1)
        row = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)
        o = backend.attend_latent(index, query, row, meta, mla.softmax_scale)
        values = torch.einsum("thl,hvl->thv", o, layer.w_uv)
        return self.ops.linear(values.reshape(-1, c.num_heads * mla.v_head_dim), layer.o_weight)


# --- the family: config.json keys and tensor names ---------------------------------------------


class DeepseekOptions(msgspec.Struct, frozen=True):
    routing: DeepseekRouting
    rope_interleave: bool = True


class _DeepseekHF(HFConfig):
    """DeepseekV3Config's keys, with its defaults."""

    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    first_k_dense_replace: int = 3
    n_group: int | None = 8
    topk_group: int | None = 4
    topk_method: str | None = None  # V2: greedy | group_limited_greedy
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rope_interleave: bool = True
    moe_layer_freq: int = 1
    quantization_config: dict | None = None


class _DeepseekV2HF(_DeepseekHF):
    """DeepseekV2Config's defaults where they differ from V3's."""

    n_routed_experts: int = 64
    n_shared_experts: int = 2
    moe_intermediate_size: int = 1407
    first_k_dense_replace: int = 0
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str | None = "greedy"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _softmax_scale(hf: _DeepseekHF) -> float:
    """transformers' yarn_apply_mscale: YaRN's mscale_all_dim scales every score."""
    scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    params = hf_rope_parameters(hf)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default" and params.get("mscale_all_dim"):
        scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def _check(hf: _DeepseekHF) -> None:
    method = (hf.quantization_config or {}).get("quant_method")
    require(method is None, "quantization_config",
            f"quant_method {method!r} (DeepSeek's FP8 blocks) is not implemented; serve a "
            "bfloat16 conversion")
    require(hf.hidden_act == "silu", "hidden_act", f"{hf.hidden_act!r} is not implemented")
    require(not hf.attention_bias, "attention_bias", "MLA projection biases are not implemented")
    require(not hf.mlp_bias, "mlp_bias", "MLP biases are not implemented")
    require(hf.moe_layer_freq == 1, "moe_layer_freq", "only every layer past the dense ones")
    require(0 < hf.num_experts_per_tok <= hf.n_routed_experts, "num_experts_per_tok",
            f"{hf.num_experts_per_tok} is not within 1..{hf.n_routed_experts}")
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        require(getattr(hf, key) > 0, key, "must be positive")
    require(hf.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even (rotary pairs)")
    require(hf.q_lora_rank is None or hf.q_lora_rank > 0, "q_lora_rank",
            "must be positive or null")


def _routing(hf: _DeepseekHF, v3: bool) -> DeepseekRouting:
    groups = hf.n_group or 1
    if not v3 and hf.topk_method in (None, "greedy"):
        groups = 1  # V2's plain greedy top-k ignores n_group
    elif not v3:
        require(hf.topk_method == "group_limited_greedy", "topk_method",
                f"{hf.topk_method!r} is not implemented")
    topk_group = hf.topk_group or groups
    require(hf.n_routed_experts % groups == 0, "n_group",
            f"{groups} groups do not divide {hf.n_routed_experts} experts")
    require(0 < topk_group <= groups, "topk_group", f"{topk_group} is not within 1..{groups}")
    require(groups == 1 or topk_group * hf.n_routed_experts // groups >= hf.num_experts_per_tok,
            "topk_group", "the kept groups hold fewer experts than num_experts_per_tok")
    require(not v3 or groups == 1 or hf.n_routed_experts // groups >= 2, "n_group",
            "V3 scores a group by its two best experts: needs two per group")
    return DeepseekRouting("sigmoid" if v3 else "softmax", groups, topk_group,
                           "top2_sum" if v3 else "max", hf.routed_scaling_factor, v3)


def read_deepseek_v3_config(raw: bytes) -> ModelConfig:
    return _read(raw, v3=True)


def read_deepseek_v2_config(raw: bytes) -> ModelConfig:
    return _read(raw, v3=False)


def _read(raw: bytes, v3: bool) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_DeepseekHF if v3 else _DeepseekV2HF)
    _check(hf)
    mla = MlaConfig(kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
                    qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                    q_lora_rank=hf.q_lora_rank, softmax_scale=_softmax_scale(hf))
    dense = tuple(range(min(hf.first_k_dense_replace, hf.num_hidden_layers)))
    moe = MoeConfig(num_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.moe_intermediate_size,
                    # V2's router never renormalises (transformers ignores the key there).
                    norm_topk_prob=hf.norm_topk_prob and v3,
                    shared_expert_intermediate_size=hf.moe_intermediate_size
                    * hf.n_shared_experts, dense_layers=dense)
    options = DeepseekOptions(_routing(hf, v3), hf.rope_interleave if v3 else True)
    heads = hf.num_attention_heads
    return config_from_hf(
        hf, "deepseek_v3" if v3 else "deepseek_v2", 4096 if v3 else 2048, moe=moe, mla=mla,
        num_kv_heads=heads, head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim,
        rotary_dim=hf.qk_rope_head_dim, family_options=options)


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    mla, moe, hidden = config.mla, config.moe, config.hidden_size
    heads, qk = config.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    attn = {
        "self_attn.kv_a_proj_with_mqa.weight": (mla.latent_width, hidden),
        "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                       mla.kv_lora_rank),
        "self_attn.o_proj.weight": (hidden, heads * mla.v_head_dim),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    if mla.q_lora_rank:
        attn |= {"self_attn.q_a_proj.weight": (mla.q_lora_rank, hidden),
                 "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
                 "self_attn.q_b_proj.weight": (heads * qk, mla.q_lora_rank)}
    else:
        attn["self_attn.q_proj.weight"] = (heads * qk, hidden)
    layer = {"mlp.gate.weight": (moe.num_experts, hidden)}
    if config.family_options.routing.correction_bias:
        layer["mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        layer |= mlp_shapes(config, f"mlp.experts.{e}.", moe.intermediate_size)
    if moe.shared_expert_intermediate_size:
        layer |= mlp_shapes(config, "mlp.shared_experts.", moe.shared_expert_intermediate_size)
    return layered_moe_shapes(config, layer, attn)


def checkpoint_names(config: ModelConfig):
    """DeepSeek-V3's checkpoints carry their multi-token-prediction layers after the last
    decoder layer (model.layers.61 of 61): not served, skipped."""

    def rename(name: str) -> str | None:
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= config.num_layers:
                return None
        return name

    return rename
