"""Llama 4 text (`Llama4ForCausalLM`, and the text model of
`Llama4ForConditionalGeneration`, served text-only): the Llama layout with

- chunked local attention in the rotary layers: a query sees only the keys of its own
  chunk of attention_chunk_size positions (engine.layers.config.LayerAttention.chunk, a
  mask the attention backend takes, as it takes sliding windows);
- NoPE layers (no_rope_layers 0: every 4th by default) with full attention, no rotary and,
  with attn_temperature_tuning, queries scaled by log1p(floor((pos + 1) / floor_scale)) *
  attn_scale + 1, so that long contexts keep their attention sharp;
- a weightless L2 (RMS) norm on q and k in the rotary layers (use_qk_norm);
- MoE MLPs in the layers moe_layers names (every interleave_moe_layer_step-th): a sigmoid
  of the top-k router logits scales each chosen expert's input (not its output), beside an
  always-on shared expert; the other layers' MLPs are dense, intermediate_size_mlp wide.

The checkpoint's rotary is GPT-J style (dims 2j, 2j + 1 rotate as a pair); the engine's is
NeoX style (j, j + head_dim / 2). Reordering each head's q and k rows at load time (even
rows first, then odd) turns one into the other and leaves every q . k unchanged; the L2
norm does not mind the order. The experts are stored stacked, [E, hidden, 2 * inter] gate
then up columns, and [E, inter, hidden].
"""

from __future__ import annotations

import functools

import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from engine.layers.config import (
    HFConfig,
    LayerAttention,
    ModelConfig,
    MoeConfig,
    config_from_gguf,
    config_from_hf,
    gguf_arch_value,
    require,
)
from engine.models.llama import LlamaModel, mlp_shapes
from engine.models.moe import ExpertLinear, MoeBlock, layered_moe_shapes


class Llama4Options(msgspec.Struct, frozen=True):
    temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    rope_qk_norm: bool = True  # the L2 norm on q and k in the rotary layers


class Llama4MoeBlock(MoeBlock):
    """Top-k of the router logits, their sigmoid scaling each chosen expert's input."""

    def route(self, x: torch.Tensor, ops=None) -> tuple[torch.Tensor, torch.Tensor]:
        linear = ops.linear if ops is not None else F.linear
        top, experts = torch.topk(linear(x, self.router), self.config.top_k, dim=-1)
        return experts, torch.sigmoid(top.float()).to(x.dtype)

    def __call__(self, x: torch.Tensor, ops) -> torch.Tensor:
        experts, scores = self.route(x, ops)
        tokens, k = experts.shape
        # One row per (token, choice), already scaled; each row through its one expert.
        rows = (x.unsqueeze(1) * scores.unsqueeze(-1)).reshape(tokens * k, -1)
        ones = torch.ones((tokens * k, 1), dtype=x.dtype, device=x.device)
        if self.stacks is not None and x.is_cuda and x.dtype == torch.bfloat16:
            run = self.grouped_gemm_experts
        else:
            run = self.grouped_experts
        out = run(rows, experts.reshape(-1, 1), ones, ops).view(tokens, k, -1).sum(dim=1)
        gate_up, down, _ = self.shared
        return out + ops.linear(ops.silu_and_mul(ops.linear(x, gate_up)), down)


def _neox_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Each head's rows reordered from GPT-J's rotary pairs to NeoX's halves."""
    heads = weight.view(-1, head_dim // 2, 2, *weight.shape[1:])
    return heads.transpose(1, 2).reshape(weight.shape)


class Llama4Model(LlamaModel):
    def _qkv_weight(self, w, attn: str) -> torch.Tensor:
        d = self.config.head_dim
        q, k, v = (w(attn + f"{x}_proj.weight") for x in "qkv")
        return torch.cat([_neox_rows(q, d), _neox_rows(k, d), v])

    def _layer(self, w, i: int):
        layer = super()._layer(w, i)
        c = self.config
        if c.family_options.rope_qk_norm and i not in c.nope_layers:
            ones = torch.ones(c.head_dim, dtype=self.dtype, device=self.device)
            layer.q_norm, layer.k_norm = ones, ones  # weightless: x / rms(x)
        return layer

    def _mlp_fields(self, w, i: int) -> dict:
        moe = self.config.moe
        if i in moe.dense_layers:
            return super()._mlp_fields(w, i)
        p = f"model.layers.{i}.mlp."
        stacked_gate_up = w(p + "experts.gate_up_proj")  # [E, hidden, 2 * inter]
        stacked_down = w(p + "experts.down_proj")  # [E, inter, hidden]
        experts = range(moe.num_experts)
        gate_up = ExpertLinear([stacked_gate_up[e].t().contiguous() for e in experts])
        down = ExpertLinear([stacked_down[e].t().contiguous() for e in experts])
        s = p + "shared_expert."
        shared = (torch.cat([w(s + "gate_proj.weight"), w(s + "up_proj.weight")]),
                  w(s + "down_proj.weight"), None)
        block = Llama4MoeBlock(moe, w(p + "router.weight"), None, gate_up, down, shared=shared)
        return dict(gate_up_weight=None, down_weight=None, moe=block)

    def _attach_quantized(self, quantized) -> None:
        """Besides the dense linears', each expert's blocks (a GGUF's ffn_*_exps, under
        per-expert names: gate then up rows, as _mlp_fields puts them)."""
        super()._attach_quantized(quantized)
        for i, layer in enumerate(self.layers):
            if layer.moe is None:
                continue
            p = f"model.layers.{i}.mlp.experts."
            experts = zip(layer.moe.gate_up.weights, layer.moe.down.weights, strict=True)
            for e, (gate_up, down) in enumerate(experts):
                self._attach(gate_up, [quantized.get(f"{p}{e}.{n}.weight")
                                       for n in ("gate_proj", "up_proj")])
                self._attach(down, [quantized.get(f"{p}{e}.down_proj.weight")])

    def _attention(self, index, layer, x, rope_at, backend, meta) -> torch.Tensor:
        """LlamaModel's, with the NoPE layers' query temperature."""
        c = self.config
        qkv = self.ops.linear(x, layer.qkv_weight, layer.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:  # before the rotation: a rotation keeps the norm
            q = self.ops.rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = self.ops.rms_norm(k, layer.k_norm, c.rms_norm_eps)
        rope, positions, tables = rope_at
        options = c.family_options
        if index not in c.nope_layers:
            q, k = self.ops.rope(rope, q, k, positions, tables)
        elif options.temperature_tuning:
            floors = torch.floor((positions.float() + 1.0) / options.floor_scale)
            scales = torch.log1p(floors) * options.attn_scale + 1.0
            q = (q * scales.view(-1, 1, 1)).to(q.dtype)
        o = backend.attend(index, q, k, v.contiguous(), meta)
        out = self.ops.linear(o.reshape(-1, self.q_size), layer.o_weight)
        return self.tp.all_reduce(out)


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    moe, hidden = config.moe, config.hidden_size
    experts, inter = moe.num_experts, moe.intermediate_size
    layer = {"mlp.router.weight": (experts, hidden),
             "mlp.experts.gate_up_proj": (experts, hidden, 2 * inter),
             "mlp.experts.down_proj": (experts, inter, hidden)}
    return layered_moe_shapes(config, layer | mlp_shapes(config, "mlp.shared_expert.", inter))


def checkpoint_names(config: ModelConfig):
    """feed_forward. as mlp.; a Llama4ForConditionalGeneration's text model from under
    language_model., its vision model and projector left out."""
    def rename(name: str) -> str | None:
        if name.startswith(("vision_model.", "multi_modal_projector.")):
            return None
        return name.removeprefix("language_model.").replace(".feed_forward.", ".mlp.", 1)

    return rename


class _Llama4HF(HFConfig):
    intermediate_size_mlp: int = 16384
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    moe_layers: list[int] | None = None
    interleave_moe_layer_step: int = 1
    use_qk_norm: bool = True
    no_rope_layers: list[int] | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    # Released configs write it as an int (4): any true value turns it on.
    attn_temperature_tuning: bool | int = True
    floor_scale: float = 8192
    attn_scale: float = 0.1
    head_dim: int | None = 128


def read_llama4_config(raw: bytes) -> ModelConfig:
    """A Llama4ForConditionalGeneration's config holds the text model's as text_config."""
    text = msgspec.json.decode(raw).get("text_config")
    hf = msgspec.json.decode(msgspec.json.encode(text) if text else raw, type=_Llama4HF)
    require(hf.hidden_act == "silu", "hidden_act",
            f"{hf.hidden_act!r} is not implemented (only silu)")
    require(not hf.attention_bias, "attention_bias", "not implemented for Llama 4")
    layers, experts = hf.num_hidden_layers, hf.num_local_experts
    require(0 < hf.num_experts_per_tok <= experts, "num_experts_per_tok",
            f"{hf.num_experts_per_tok} is not within 1..{experts}")
    rotary = _per_layer_flags(hf, layers)
    chunk = hf.attention_chunk_size
    require(chunk is None or chunk > 0, "attention_chunk_size", f"{chunk} is not positive")
    types = hf.layer_types or ["chunked_attention" if r and chunk is not None
                               else "full_attention" for r in rotary]
    require(len(types) == layers and set(types) <= {"chunked_attention", "full_attention"},
            "layer_types", f"needs one of chunked_attention / full_attention per layer "
            f"({layers})")
    require(chunk is not None or "chunked_attention" not in types, "attention_chunk_size",
            "chunked_attention layers need a chunk size")
    moe_layers = hf.moe_layers
    if moe_layers is None:
        step = hf.interleave_moe_layer_step
        require(step > 0, "interleave_moe_layer_step", f"{step} is not positive")
        moe_layers = list(range(step - 1, layers, step))
    require(set(moe_layers) <= set(range(layers)), "moe_layers",
            f"names layers outside 0..{layers - 1}")
    moe = MoeConfig(num_experts=experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.intermediate_size, routing="sigmoid_topk",
                    shared_expert_intermediate_size=hf.intermediate_size,
                    dense_layers=tuple(i for i in range(layers) if i not in moe_layers))
    require(hf.floor_scale > 0, "floor_scale", f"{hf.floor_scale} is not positive")
    options = Llama4Options(bool(hf.attn_temperature_tuning), float(hf.floor_scale),
                            float(hf.attn_scale), hf.use_qk_norm)
    attention = tuple(LayerAttention(chunk=chunk if t == "chunked_attention" else None)
                      for t in types)
    hf.intermediate_size = hf.intermediate_size_mlp  # the dense layers' width
    return config_from_hf(hf, "llama4", 131072, moe=moe, layer_attention=attention,
                          nope_layers=tuple(i for i, r in enumerate(rotary) if not r),
                          family_options=options)


def _per_layer_flags(hf: _Llama4HF, layers: int) -> list[int]:
    """no_rope_layers (1: rotary, 0: NoPE), or, where it is absent or empty (Scout's
    config.json writes []), every no_rope_layer_interval-th NoPE, as transformers reads it."""
    if not hf.no_rope_layers:
        every = hf.no_rope_layer_interval
        require(every > 0, "no_rope_layer_interval", f"{every} is not positive")
        return [int((i + 1) % every != 0) for i in range(layers)]
    require(len(hf.no_rope_layers) == layers and set(hf.no_rope_layers) <= {0, 1},
            "no_rope_layers", f"needs one 0 or 1 per layer ({layers})")
    return hf.no_rope_layers


# --- GGUF (llama.cpp's convert_hf_to_gguf.py, general.architecture "llama4") -------------------

GGUF_LAYER_NAMES = {"ffn_gate_inp": "mlp.router"}
_GGUF_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# What llama.cpp fixes for every llama4 file rather than reading it (llama-model.cpp).
_GGUF_CHUNK, _GGUF_NOPE_EVERY, _GGUF_FLOOR_SCALE, _GGUF_ATTN_SCALE = 8192, 4, 8192.0, 0.1


def read_llama4_gguf(reader) -> ModelConfig:
    """llama.cpp's llama4, as llama.cpp reads it: chunks of 8192 in three of every four
    layers, the fourth NoPE with temperature tuning (0.1, 8192), the QK norm except in the
    128-expert model (Maverick), MoE every interleave_moe_layer_step-th layer. q/k rows are
    stored as the checkpoint's (no permutation: llama4 rotates GPT-J style in llama.cpp too)."""
    meta = functools.partial(gguf_arch_value, reader)
    require(meta("attention.sliding_window", None) != 0, "GGUF attention.sliding_window",
            "0 (no chunked attention) is not implemented")
    layers, experts, step = meta("block_count"), meta("expert_count"), \
        meta("interleave_moe_layer_step")
    require(step > 0, "GGUF interleave_moe_layer_step", f"{step} is not positive")
    nope = tuple(i for i in range(layers) if (i + 1) % _GGUF_NOPE_EVERY == 0)
    moe = MoeConfig(num_experts=experts, top_k=meta("expert_used_count"),
                    intermediate_size=meta("expert_feed_forward_length"),
                    routing="sigmoid_topk",
                    shared_expert_intermediate_size=meta("expert_feed_forward_length"),
                    dense_layers=tuple(i for i in range(layers) if (i + 1) % step))
    options = Llama4Options(True, _GGUF_FLOOR_SCALE, _GGUF_ATTN_SCALE, experts != 128)
    attention = tuple(LayerAttention(chunk=None if i in nope else _GGUF_CHUNK)
                      for i in range(layers))
    return config_from_gguf(reader, architecture="llama4", moe=moe, nope_layers=nope,
                            layer_attention=attention, family_options=options)


def gguf_tensors(arrays: dict[str, np.ndarray], hf_name) -> dict[str, np.ndarray]:
    """A llama4 GGUF's tensors under the checkpoint's names: each layer's ffn_gate_exps and
    ffn_up_exps [E, inter, hidden] back into one stacked gate_up_proj [E, hidden, 2 * inter]
    (gate columns, then up), ffn_down_exps [E, hidden, inter] into down_proj [E, inter,
    hidden]."""
    named, experts = {}, {}
    for name, array in arrays.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:
            experts[(parts[1], parts[2])] = array
            continue
        hf = hf_name(name)
        if hf is None:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        named[hf] = array
    for layer in sorted({layer for layer, _ in experts}):
        p = f"model.layers.{layer}.mlp.experts."
        gate, up = experts.get((layer, "ffn_gate_exps")), experts.get((layer, "ffn_up_exps"))
        if gate is None or up is None or (layer, "ffn_down_exps") not in experts:
            raise ValueError(f"GGUF block {layer} lacks one of {', '.join(_GGUF_EXPERTS)}")
        named[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1).transpose(0, 2, 1)
        named[p + "down_proj"] = experts[(layer, "ffn_down_exps")].transpose(0, 2, 1)
    return named
