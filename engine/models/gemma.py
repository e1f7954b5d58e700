"""Gemma, Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's own arithmetic.

Differences from engine.models.llama, in transformers' order: the embedding is scaled by
sqrt(hidden); every RMSNorm multiplies by (1 + w) (folded into the weight at load, exact in
float32); the MLP is GeGLU (tanh-approximated GELU). That is all of Gemma (1). From Gemma 2
on, each block norms its attention and MLP outputs again before the residual add
(post-attention and post-feedforward norms, besides the usual pre-norms: "sandwich" norms)
and scores are scaled by query_pre_attn_scalar ** -0.5. Layers
alternate sliding-window and global attention (engine.layers.config.LayerAttention), and
Gemma 3 gives each kind its own rotary base and q/k norms. Gemma 2 soft-caps the attention
scores and the final logits.
"""

from __future__ import annotations

import functools

import msgspec
import torch
import torch.nn.functional as F

from engine.layers.config import (
    HFConfig,
    LayerAttention,
    ModelConfig,
    config_from_gguf,
    config_from_hf,
    gguf_arch_value,
    hf_rope,
    hf_rope_parameters,
    layer_windows,
    require,
)
from engine.layers.rotary import RotaryEmbedding
from engine.layers.tp_group import SINGLE, TPGroup
from engine.models.llama import DecoderLayer, LlamaModel, attention_shapes, mlp_shapes


class GemmaOptions(msgspec.Struct, frozen=True):
    # Gemma 2 and 3's four norms a block; Gemma (1) has Llama's two.
    sandwich_norms: bool = True
    final_logit_softcapping: float | None = None
    # llama.cpp's GGUF files store each norm weight as (1 + w) already.
    norms_hold_one: bool = False
    # Gemma 3: the sliding layers' rotary base and scaling (the global ones': the config's).
    local_rope_theta: float | None = None
    local_rope_scaling: object | None = None


def _norm_offset(config: ModelConfig) -> float:
    """What the (1 + w) RMSNorm adds to a stored norm weight: 1, or 0 where the file holds
    1 + w already (GGUF)."""
    return 0.0 if config.family_options.norms_hold_one else 1.0


class GemmaLayer(DecoderLayer):
    pre_feedforward_norm: torch.Tensor | None = None
    post_feedforward_norm: torch.Tensor | None = None


class GemmaModel(LlamaModel):
    def __init__(self, config: ModelConfig, weights, max_positions, dtype, device, ops=None,
                 quantized=None, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, weights, max_positions, dtype, device, ops=ops,
                         quantized=quantized, tp=tp)
        options = config.family_options
        self.norm = self.norm + _norm_offset(config)
        self.local_rope = self.rope
        if options.local_rope_theta is not None:
            self.local_rope = RotaryEmbedding(config, max_positions, dtype, device,
                                              theta=options.local_rope_theta,
                                              scaling=options.local_rope_scaling,
                                              use_config_scaling=False)
        # transformers rounds the scale to the model's dtype before multiplying.
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype)

    def _layer(self, w, i: int) -> GemmaLayer:
        p = f"model.layers.{i}."
        attn = p + "self_attn."

        def norm(name: str) -> torch.Tensor:
            return w(name) + _norm_offset(self.config)

        if not self.config.family_options.sandwich_norms:  # Llama's two norms, Gemma's math
            return GemmaLayer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv_weight=self._qkv_weight(w, attn), qkv_bias=None, q_norm=None, k_norm=None,
                o_weight=w(attn + "o_proj.weight"),
                post_attention_norm=norm(p + "post_attention_layernorm.weight"),
                **self._mlp_fields(w, i))
        return GemmaLayer(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv_weight=self._qkv_weight(w, attn),
            qkv_bias=self._qkv_bias(w, attn),
            q_norm=norm(attn + "q_norm.weight") if self.config.qk_norm else None,
            k_norm=norm(attn + "k_norm.weight") if self.config.qk_norm else None,
            o_weight=w(attn + "o_proj.weight"),
            post_attention_norm=norm(p + "post_attention_layernorm.weight"),
            pre_feedforward_norm=norm(p + "pre_feedforward_layernorm.weight"),
            post_feedforward_norm=norm(p + "post_feedforward_layernorm.weight"),
            **self._mlp_fields(w, i),
        )

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed_tokens(input_ids) * self.embed_scale

    def forward(self, input_ids, positions, backend, meta, embeds=None) -> torch.Tensor:
        if not self.config.family_options.sandwich_norms:
            return super().forward(input_ids, positions, backend, meta, embeds)
        h = self._embed_tokens(input_ids)
        ropes = {}
        for rope in (self.rope, self.local_rope):
            ropes[id(rope)] = (rope, positions, self.ops.rope_tables(rope, positions))
        eps, ops = self.config.rms_norm_eps, self.ops
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            local = self.config.attention_of(index).window is not None
            rope_at = ropes[id(self.local_rope if local else self.rope)]
            attn = self._attention(index, layer, x, rope_at, backend, meta)
            attn = ops.rms_norm(attn, layer.post_attention_norm, eps)
            x, h = ops.add_rms_norm(h, attn, layer.pre_feedforward_norm, eps)
            mlp = ops.rms_norm(self._mlp(layer, x), layer.post_feedforward_norm, eps)
            if index == len(self.layers) - 1:
                return h + mlp
            x, h = ops.add_rms_norm(h, mlp, self.layers[index + 1].input_norm, eps)
        return h

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (the MLP around it, and its tensor-parallel sum, are Llama's)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().logits(hidden)
        cap = self.config.family_options.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden = config.hidden_size
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    norms = ({f"{n}_feedforward_layernorm.weight": (hidden,) for n in ("pre", "post")}
             if config.family_options.sandwich_norms else {})
    for i in range(config.num_layers):
        layer = attention_shapes(config) | mlp_shapes(config) | norms
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


class _GemmaHF(HFConfig):
    use_bidirectional_attention: bool | None = None  # EmbeddingGemma's encoder
    hidden_act: str = "gelu_pytorch_tanh"  # transformers' Gemma default, not Llama's silu
    head_dim: int = 256
    hidden_activation: str | None = None
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    # Gemma 3 configs written by transformers 4.x
    rope_local_base_freq: float | None = None
    sliding_window_pattern: int | None = None


def _read(raw: bytes, default_pattern: int) -> tuple[_GemmaHF, int, list]:
    hf = msgspec.json.decode(raw, type=_GemmaHF)
    act = hf.hidden_activation or hf.hidden_act
    require(act in ("gelu_pytorch_tanh", "gelu"), "hidden_activation",
            f"{act!r} is not implemented (only gelu_pytorch_tanh)")
    require(not hf.attention_bias, "attention_bias", "not implemented for Gemma")
    max_positions = hf.max_position_embeddings or 8192
    if hf.layer_types is None:  # older configs: every `pattern`-th layer is global
        pattern = hf.sliding_window_pattern or default_pattern
        hf.layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                          for i in range(hf.num_hidden_layers)]
    return hf, max_positions, layer_windows(hf, max_positions)


def _layers(hf: _GemmaHF, windows, softcap) -> tuple[LayerAttention, ...]:
    scale = hf.query_pre_attn_scalar**-0.5
    return tuple(LayerAttention(window=w, scale=scale, softcap=softcap) for w in windows)


def read_gemma_config(raw: bytes) -> ModelConfig:
    """Gemma (1): scores scaled by head_dim ** -0.5, no windows, no soft-capping.
    transformers reads its legacy hidden_act "gelu" as the tanh approximation too."""
    hf = msgspec.json.decode(raw, type=_GemmaHF)
    require(hf.hidden_act in ("gelu_pytorch_tanh", "gelu"), "hidden_act",
            f"{hf.hidden_act!r} is not implemented (only gelu_pytorch_tanh)")
    require(not hf.attention_bias, "attention_bias", "not implemented for Gemma")
    require(not hf.use_bidirectional_attention, "use_bidirectional_attention",
            "a bidirectional (encoder) Gemma is not served")
    max_positions = hf.max_position_embeddings or 8192
    scale = hf.head_dim**-0.5
    layers = tuple(LayerAttention(window=None, scale=scale, softcap=None)
                   for _ in range(hf.num_hidden_layers))
    return config_from_hf(hf, "gemma", max_positions, layer_attention=layers,
                          family_options=GemmaOptions(sandwich_norms=False))


def read_gemma2_config(raw: bytes) -> ModelConfig:
    hf, max_positions, windows = _read(raw, default_pattern=2)
    return config_from_hf(
        hf, "gemma2", max_positions,
        layer_attention=_layers(hf, windows, hf.attn_logit_softcapping),
        family_options=GemmaOptions(final_logit_softcapping=hf.final_logit_softcapping))


def read_gemma3_config(raw: bytes) -> ModelConfig:
    hf, max_positions, windows = _read(raw, default_pattern=6)
    require(hf.attn_logit_softcapping is None, "attn_logit_softcapping",
            "Gemma 3 does not soft-cap attention")
    params = hf_rope_parameters(hf)
    if "full_attention" in params:  # transformers 5: one rotary setting per layer type
        full, local = params["full_attention"], params.get("sliding_attention", {})
    else:
        full = params
        local = {"rope_theta": hf.rope_local_base_freq or 10000.0}
    local_theta, local_scaling = hf_rope(local)
    options = GemmaOptions(final_logit_softcapping=hf.final_logit_softcapping,
                           local_rope_theta=local_theta, local_rope_scaling=local_scaling)
    return config_from_hf(hf, "gemma3", max_positions, rope=full, qk_norm=True,
                          layer_attention=_layers(hf, windows, None), family_options=options)


# --- GGUF (llama.cpp's convert_hf_to_gguf.py) ---------------------------------------------------

# llama.cpp's names for Gemma's four block norms (its ffn_norm is the pre-feedforward one).
GGUF_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_layers(reader, pattern: int, layers_27b: int, softcap) -> tuple[LayerAttention, ...]:
    """Each layer's attention as llama.cpp computes it from the file: every `pattern`-th
    layer global, the rest windowed (or the file's own per-layer pattern); the score scale
    1 / sqrt(head_dim), except for the 27B models (told by their layer count, as llama.cpp
    tells them), whose query_pre_attn_scalar is hidden / heads."""
    meta = functools.partial(gguf_arch_value, reader)
    layers, window = meta("block_count"), meta("attention.sliding_window")
    require(window > 0, "GGUF attention.sliding_window", f"{window} is not a positive window")
    stated = meta("attention.sliding_window_pattern", None)
    if isinstance(stated, list):
        require(len(stated) == layers, "GGUF attention.sliding_window_pattern",
                f"{len(stated)} entries for {layers} layers")
        windowed = [bool(w) for w in stated]
    else:
        every = stated or pattern
        windowed = [bool((i + 1) % every) for i in range(layers)]
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    scalar = hidden / heads if layers == layers_27b else meta("attention.key_length")
    return tuple(LayerAttention(window=window if w else None, scale=scalar**-0.5,
                                softcap=softcap) for w in windowed)


def read_gemma_gguf(reader) -> ModelConfig:
    """Gemma (1) as llama.cpp writes it: norms hold 1 + w, Llama's tensor names."""
    scale = gguf_arch_value(reader, "attention.key_length")**-0.5
    layers = tuple(LayerAttention(window=None, scale=scale, softcap=None)
                   for _ in range(gguf_arch_value(reader, "block_count")))
    return config_from_gguf(reader, layer_attention=layers, family_options=GemmaOptions(
        sandwich_norms=False, norms_hold_one=True))


def read_gemma2_gguf(reader) -> ModelConfig:
    meta = functools.partial(gguf_arch_value, reader)
    return config_from_gguf(
        reader, layer_attention=_gguf_layers(reader, 2, 46, meta("attn_logit_softcapping", None)),
        family_options=GemmaOptions(final_logit_softcapping=meta("final_logit_softcapping", None),
                                    norms_hold_one=True))


def read_gemma3_gguf(reader) -> ModelConfig:
    """Gemma 3: the file's rotary base and scaling are the global layers'; the sliding
    layers' base is rope.freq_base_swa where written, else llama.cpp's 10000, unscaled."""
    meta = functools.partial(gguf_arch_value, reader)
    options = GemmaOptions(final_logit_softcapping=meta("final_logit_softcapping", None),
                           local_rope_theta=float(meta("rope.freq_base_swa", 10000.0)),
                           norms_hold_one=True)
    return config_from_gguf(reader, qk_norm=True, family_options=options,
                            layer_attention=_gguf_layers(reader, 6, 62, None))
