"""Mixture-of-experts decoders: Qwen2-MoE, Qwen3-MoE and Mixtral, and the MoE MLP block they
(and gpt-oss) share.

Attention and norms are the Llama family's (engine.models.llama); each MoE layer's MLP
routes every token to its top-k experts. Tokens are grouped by expert, so each expert's rows
go through one matmul per projection (a loop over the experts a step uses, never over
tokens), and the results are summed back per token, weighted by the router. On CUDA, with
bfloat16 experts, every expert's rows go through one grouped GEMM per projection instead
(`F.grouped_mm`: one kernel, not one launch per expert); the CPU tests run that path too.

SLUICE_MOE_PER_TOKEN=1 in the engine's environment runs every token's k experts one by one
instead (`MoeBlock.per_token_experts`): a reference for the benchmark of grouping
(docs/benchmarks.md), never for serving.
"""

from __future__ import annotations

import os

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
    whole_model_window,
)
from engine.layers.safetensors_weights import in_mapped_file
from engine.models.llama import LlamaModel, attention_shapes, mlp_shapes


class ExpertLinear(msgspec.Struct):
    """Every expert's weight of one projection, [out, in] each, with optional biases. An
    expert's gate_up may be its (gate, up) pair instead, where both stay in the memory-mapped
    checkpoint apart (`expert_gate_up`): two matmuls rather than a copy of the pair."""

    weights: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    biases: list[torch.Tensor] | None = None


def expert_gate_up(gate: torch.Tensor, up: torch.Tensor):
    """One expert's gate and up rows as one [2 * inter, hidden] weight: where both are in
    the memory-mapped checkpoint (engine.layers.safetensors_weights.in_mapped_file), a view
    over both when they lie back to back there (save_pretrained writes Qwen-MoE's gate_proj and
    up_proj so), else the pair itself (Mixtral's w1 and w3, with w2 between them); loaded
    tensors are concatenated."""
    if not (in_mapped_file(gate) and in_mapped_file(up)):
        return torch.cat([gate, up])
    rows = gate.shape[0] + up.shape[0]
    back_to_back = (gate.is_contiguous() and up.is_contiguous() and gate.dtype == up.dtype
                    and gate.shape[1:] == up.shape[1:]
                    and gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
                    and up.storage_offset() == gate.storage_offset() + gate.numel())
    if back_to_back:
        return gate.as_strided((rows, *gate.shape[1:]), gate.stride())
    return gate, up


def group_limited_top_k(scores: torch.Tensor, choice: torch.Tensor, num_groups: int,
                        top_groups: int, top_k: int, norm_topk_prob: bool, scale: float,
                        group_score: str = "top2_sum") -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's expert choice (V3 and GLM-4.5; V2 with group_score "max"): `choice` (the
    scores, plus V3's correction bias) keeps the best `top_groups` of `num_groups` expert
    groups, each group scored by its best two choices (or its best one), then the `top_k`
    experts among them. Their weights are `scores` (not `choice`), renormalised if asked,
    times `scale`. Float32 in and out: (experts [T, top_k], weights [T, top_k])."""
    if num_groups > 1:
        groups = choice.view(choice.shape[0], num_groups, -1)
        if group_score == "top2_sum":
            group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = groups.max(dim=-1).values
        kept = group_scores.topk(top_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(groups.shape[-1], dim=1),
                                    float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * scale


class ExpertStacks(msgspec.Struct):
    """Every expert's weights of one layer as one [experts, out, in] tensor per projection
    (and [experts, out] biases), as a grouped GEMM takes them."""

    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def _stackable(gate_up: ExpertLinear, down: ExpertLinear) -> bool:
    """Whether every expert's weights are plain tensors of one shape (not mapped pairs,
    not quantized blocks), as one stacked tensor per projection needs."""
    return all(
        proj.weights and all(isinstance(w, torch.Tensor) and w.dtype.is_floating_point
                             and w.shape == proj.weights[0].shape for w in proj.weights)
        for proj in (gate_up, down))


class MoeBlock:
    """Router, experts and (Qwen2-MoE) the gated shared expert of one layer.

    gate_up: each expert's gate rows then up rows; `activation` turns [n, 2 * inter] into
    [n, inter] (ops.silu_and_mul for SwiGLU experts)."""

    def __init__(self, config: MoeConfig, router: torch.Tensor, router_bias, gate_up:
                 ExpertLinear, down: ExpertLinear, activation=None, shared=None) -> None:
        self.config = config
        self.router, self.router_bias = router, router_bias
        self.gate_up, self.down = gate_up, down
        self.activation = activation
        # (gate_up [2 * inter, hidden], down [hidden, inter], gate [1, hidden] or None) or None
        self.shared = shared
        self.per_token = os.environ.get("SLUICE_MOE_PER_TOKEN") == "1"  # the benchmark's
        self.stacks: ExpertStacks | None = None  # for the grouped GEMM; None: the loop
        if _stackable(gate_up, down) and gate_up.weights[0].is_cuda:
            self.stack_experts()

    def stack_experts(self) -> None:
        """Holds each projection's experts in one [experts, out, in] tensor, which the
        per-expert lists then view (no second copy), so the grouped GEMM can take them."""
        stacks = []
        for proj in (self.gate_up, self.down):
            weights = torch.stack(proj.weights)
            proj.weights = list(weights.unbind(0))
            biases = torch.stack(proj.biases) if proj.biases else None
            if biases is not None:
                proj.biases = list(biases.unbind(0))
            stacks += [weights, biases]
        self.stacks = ExpertStacks(*stacks)

    def linear_weights(self) -> list[torch.Tensor]:
        shared = [self.shared[0], self.shared[1]] if self.shared else []
        experts = []
        for w in self.gate_up.weights + self.down.weights:
            experts.extend(w if isinstance(w, tuple) else (w,))
        return experts + shared

    def route(self, x: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] and their weights [T, k], as the checkpoint's
        transformers router computes them. Through ops.linear where given: in the
        batch-invariant mode a token's logits, so its experts, must not depend on the batch
        (F.linear's blocking does: a row routed alone and among 40 got other weights)."""
        c = self.config
        linear = ops.linear if ops is not None else F.linear
        logits = linear(x, self.router, self.router_bias)
        if c.routing == "topk_softmax":  # gpt-oss: softmax over the chosen k logits
            top, experts = torch.topk(logits, c.top_k, dim=-1)
            return experts, F.softmax(top, dim=-1, dtype=top.dtype)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top, experts = torch.topk(probs, c.top_k, dim=-1)
        if c.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return experts, top.to(x.dtype)

    def __call__(self, x: torch.Tensor, ops) -> torch.Tensor:
        """x: [T, hidden], normed -> [T, hidden]."""
        experts, weights = self.route(x, ops)
        if self.per_token:
            run = self.per_token_experts
        elif self.stacks is not None and x.is_cuda and x.dtype == torch.bfloat16:
            run = self.grouped_gemm_experts  # the kernel takes bfloat16 on CUDA only
        else:
            run = self.grouped_experts
        out = run(x, experts, weights, ops)
        if self.shared is not None:
            gate_up, down, gate = self.shared
            shared = ops.linear(ops.silu_and_mul(ops.linear(x, gate_up)), down)
            # Qwen2-MoE gates its shared expert; GLM-4.5's and Llama 4's (gate None) are not.
            out = out + (shared if gate is None else torch.sigmoid(F.linear(x, gate)) * shared)
        return out

    def grouped_experts(self, x, experts, weights, ops) -> torch.Tensor:
        tokens, k = experts.shape
        flat = experts.reshape(-1)  # [T * k]: token t's j-th choice at t * k + j
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
        # index_select, not x[...] or index_add_: torch's CPU indexing and scatter kernels
        # cost more than the experts' matmuls at decode sizes (docs/benchmarks.md).
        rows = x.index_select(0, order // k)  # the tokens, grouped by expert
        results = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                part = slice(start, start + count)
                results[part] = self._expert(expert, rows[part], ops)
                start += count
        # Back to token order (each token's k results side by side), weighted and summed.
        per_choice = results.index_select(0, torch.argsort(order)).view(tokens, k, -1)
        return (per_choice * weights.unsqueeze(-1)).sum(dim=1)

    def grouped_gemm_experts(self, x, experts, weights, ops) -> torch.Tensor:
        """grouped_experts with each projection as one grouped GEMM over the stacks: the
        rows sorted by expert, `offs` where each expert's rows end."""
        stacks = self.stacks
        tokens, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        ends = torch.cumsum(torch.bincount(flat, minlength=len(stacks.gate_up)), 0)
        ends = ends.to(torch.int32)
        rows = x.index_select(0, order // k)
        row_expert = flat.index_select(0, order)  # each sorted row's expert, for its bias
        hidden = F.grouped_mm(rows, stacks.gate_up.transpose(1, 2), offs=ends)
        if stacks.gate_up_bias is not None:
            hidden = hidden + stacks.gate_up_bias.index_select(0, row_expert)
        act = self.activation(hidden) if self.activation else ops.silu_and_mul(hidden)
        results = F.grouped_mm(act, stacks.down.transpose(1, 2), offs=ends)
        if stacks.down_bias is not None:
            results = results + stacks.down_bias.index_select(0, row_expert)
        per_choice = results.index_select(0, torch.argsort(order)).view(tokens, k, -1)
        return (per_choice * weights.unsqueeze(-1)).sum(dim=1)

    def per_token_experts(self, x, experts, weights, ops) -> torch.Tensor:
        """The naive way, for benchmarks only: each token through its k experts in turn."""
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(experts.shape[1]):
                e = int(experts[t, j])
                out[t] += weights[t, j] * self._expert(e, x[t : t + 1], ops)[0]
        return out

    def _expert(self, e: int, rows: torch.Tensor, ops) -> torch.Tensor:
        up_bias = self.gate_up.biases[e] if self.gate_up.biases else None
        down_bias = self.down.biases[e] if self.down.biases else None
        gate_up = self.gate_up.weights[e]
        if isinstance(gate_up, tuple):  # a mapped pair (no biases: only gpt-oss has them)
            hidden = torch.cat([ops.linear(rows, gate_up[0]), ops.linear(rows, gate_up[1])],
                               dim=-1)
        else:
            hidden = ops.linear(rows, gate_up, up_bias)
        act = self.activation(hidden) if self.activation else ops.silu_and_mul(hidden)
        return ops.linear(act, self.down.weights[e], down_bias)


# --- Qwen2-MoE, Qwen3-MoE, Mixtral ---------------------------------------------------------------


class _Names(msgspec.Struct, frozen=True):
    """Where a family keeps one MoE layer's tensors, relative to model.layers.{i}."""

    block: str  # the MoE MLP's module
    router: str
    gate: str  # an expert's gate / up / down projection, under {block}experts.{e}.
    up: str
    down: str


_QWEN = _Names("mlp.", "gate", "gate_proj", "up_proj", "down_proj")
_MIXTRAL = _Names("block_sparse_moe.", "gate", "w1", "w3", "w2")


class MoeModel(LlamaModel):
    """The Llama-family model with an MoE MLP in every layer the config does not list as
    dense; tensors named as Qwen-MoE names them."""

    names = _QWEN

    def _mlp_fields(self, w, i: int) -> dict:
        moe = self.config.moe
        if i in moe.dense_layers:
            return super()._mlp_fields(w, i)
        names = self.names
        p = f"model.layers.{i}.{names.block}"

        def expert(e: int, proj: str) -> str:
            return f"{p}experts.{e}.{proj}.weight"

        experts = range(moe.num_experts)
        gate_up = ExpertLinear([expert_gate_up(w(expert(e, names.gate)), w(expert(e, names.up)))
                                for e in experts])
        down = ExpertLinear([w(expert(e, names.down)) for e in experts])
        shared = None
        if moe.shared_expert_intermediate_size:
            s = p + "shared_expert."
            shared = (torch.cat([w(s + "gate_proj.weight"), w(s + "up_proj.weight")]),
                      w(s + "down_proj.weight"), w(p + "shared_expert_gate.weight"))
        block = MoeBlock(moe, w(f"{p}{names.router}.weight"), None, gate_up, down,
                         shared=shared)
        return dict(gate_up_weight=None, down_weight=None, moe=block)

    def _attach_quantized(self, quantized) -> None:
        """Besides the dense linears', each expert's blocks (a GGUF's ffn_*_exps stored in a
        kind the CPU kernels take): the ops multiply an expert's rows by them (all of them,
        where the expert was loaded as blocks only; else the few of a decode step)."""
        super()._attach_quantized(quantized)
        names = self.names
        for i, layer in enumerate(self.layers):
            if layer.moe is None:
                continue
            p = f"model.layers.{i}.{names.block}experts."
            experts = zip(layer.moe.gate_up.weights, layer.moe.down.weights, strict=True)
            for e, (gate_up, down) in enumerate(experts):
                found = [quantized.get(f"{p}{e}.{n}.weight") for n in (names.gate, names.up)]
                if isinstance(gate_up, tuple):  # a mapped pair: one weight each
                    self._attach(gate_up[0], found[:1])
                    self._attach(gate_up[1], found[1:])
                else:
                    self._attach(gate_up, found)
                self._attach(down, [quantized.get(f"{p}{e}.{names.down}.weight")])


class MixtralModel(MoeModel):
    names = _MIXTRAL


def mixtral_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return tensor_shapes(config, _MIXTRAL)


def layered_moe_shapes(config: ModelConfig, moe_layer: dict[str, tuple[int, ...]],
                       attention: dict[str, tuple[int, ...]] | None = None
                       ) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a MoE model: embeddings, final norm, LM head unless tied, and each
    layer's attention (`attention`, else Llama's) with a dense MLP in `moe.dense_layers` and
    the family's MoE block (`moe_layer`, names under the layer) everywhere else."""
    hidden = config.hidden_size
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    attention = attention_shapes(config) if attention is None else attention
    for i in range(config.num_layers):
        mlp = mlp_shapes(config) if i in config.moe.dense_layers else moe_layer
        shapes.update({f"model.layers.{i}.{k}": v for k, v in (attention | mlp).items()})
    return shapes


def tensor_shapes(config: ModelConfig, names: _Names = _QWEN) -> dict[str, tuple[int, ...]]:
    moe, hidden = config.moe, config.hidden_size
    inter, p = moe.intermediate_size, names.block
    layer = {f"{p}{names.router}.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        layer[f"{p}experts.{e}.{names.gate}.weight"] = (inter, hidden)
        layer[f"{p}experts.{e}.{names.up}.weight"] = (inter, hidden)
        layer[f"{p}experts.{e}.{names.down}.weight"] = (hidden, inter)
    if moe.shared_expert_intermediate_size:
        layer |= mlp_shapes(config, p + "shared_expert.", moe.shared_expert_intermediate_size)
        layer[f"{p}shared_expert_gate.weight"] = (1, hidden)
    return layered_moe_shapes(config, layer)


class _QwenMoeHF(HFConfig):
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts.
    num_experts: int | None = None
    num_local_experts: int | None = None
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = True  # Qwen2-MoE's q/k/v biases


def _qwen_moe(raw: bytes, architecture: str, **fields) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_QwenMoeHF)
    _check_experts_act(hf)
    require(not hf.use_sliding_window, "use_sliding_window",
            f"not implemented for {hf.model_type}")
    num_experts = hf.num_experts or hf.num_local_experts or 0
    require(num_experts > 0, "num_experts", "an MoE model needs experts")
    require(0 < hf.num_experts_per_tok <= num_experts, "num_experts_per_tok",
            f"{hf.num_experts_per_tok} is not within 1..{num_experts}")
    require(hf.decoder_sparse_step > 0, "decoder_sparse_step", "must be positive")
    dense = tuple(i for i in range(hf.num_hidden_layers)
                  if i in hf.mlp_only_layers or (i + 1) % hf.decoder_sparse_step)
    moe = MoeConfig(num_experts=num_experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.moe_intermediate_size,
                    norm_topk_prob=hf.norm_topk_prob, dense_layers=dense,
                    shared_expert_intermediate_size=fields.pop("shared", 0))
    return config_from_hf(hf, architecture, 32768, moe=moe, **fields)


def read_qwen3_moe_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_QwenMoeHF)
    require(not hf.attention_bias, "attention_bias", "an o_proj bias is not implemented")
    return _qwen_moe(raw, "qwen3_moe", qk_norm=True)


def read_qwen2_moe_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_QwenMoeHF)
    require(hf.shared_expert_intermediate_size > 0, "shared_expert_intermediate_size",
            "Qwen2-MoE needs its shared expert")
    return _qwen_moe(raw, "qwen2_moe", attention_bias=hf.qkv_bias,
                     shared=hf.shared_expert_intermediate_size)


class _MixtralHF(HFConfig):
    num_local_experts: int = 8
    num_experts_per_tok: int = 2


def read_mixtral_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=_MixtralHF)
    _check_experts_act(hf)
    require(not hf.attention_bias, "attention_bias", "not implemented for Mixtral")
    require(0 < hf.num_experts_per_tok <= hf.num_local_experts, "num_experts_per_tok",
            f"{hf.num_experts_per_tok} is not within 1..{hf.num_local_experts}")
    max_positions = hf.max_position_embeddings or 4096 * 32
    layers = whole_model_window(hf, max_positions)
    # Mixtral always renormalises the chosen experts' weights.
    moe = MoeConfig(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.intermediate_size, norm_topk_prob=True)
    return config_from_hf(hf, "mixtral", max_positions, moe=moe, layer_attention=layers)


def _check_experts_act(hf: HFConfig) -> None:
    require(hf.hidden_act == "silu", "hidden_act",
            f"{hf.hidden_act!r} is not implemented (only silu)")


def _gguf_moe(reader, norm_topk_prob: bool, shared: int = 0) -> MoeConfig:
    """An MoE GGUF's experts: counts from the metadata; layers without a router tensor are
    dense."""
    routed = {int(t.name.split(".")[1]) for t in reader.tensors
              if t.name.endswith("ffn_gate_inp.weight")}
    layers = gguf_arch_value(reader, "block_count")
    return MoeConfig(num_experts=gguf_arch_value(reader, "expert_count"),
                     top_k=gguf_arch_value(reader, "expert_used_count"),
                     intermediate_size=gguf_arch_value(reader, "expert_feed_forward_length"),
                     norm_topk_prob=norm_topk_prob, shared_expert_intermediate_size=shared,
                     dense_layers=tuple(i for i in range(layers) if i not in routed))


def read_qwen3_moe_gguf(reader) -> ModelConfig:
    """llama.cpp's qwen3moe, which renormalises the chosen experts' weights
    (norm_topk_prob), as every released Qwen3-MoE config asks."""
    moe = _gguf_moe(reader, norm_topk_prob=True)
    return config_from_gguf(reader, qk_norm=True, moe=moe, architecture="qwen3_moe")


def read_qwen2_moe_gguf(reader) -> ModelConfig:
    """llama.cpp's qwen2moe: q/k/v biases, a shared expert, no renormalising (as
    Qwen1.5-MoE and Qwen2-57B-A14B's configs ask)."""
    shared = gguf_arch_value(reader, "expert_shared_feed_forward_length")
    moe = _gguf_moe(reader, norm_topk_prob=False, shared=shared)
    return config_from_gguf(reader, attention_bias=True, moe=moe, architecture="qwen2_moe")
