"""The Llama family (Llama, Mistral, SmolLM) plus Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

Written against the attention-backend interface: the model sees a flattened batch of tokens
from many sequences (prefill chunks and decodes mixed) and never knows how the KV cache is
laid out. Weights come in with Hugging Face names (see `engine.models.weights`); the math
follows transformers' implementation step for step, since it is our numerical reference.
"""

from __future__ import annotations

import math

import msgspec
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.models.config import ModelConfig
from engine.models.ops import TorchOps
from engine.models.weights import QuantizedWeight


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, looked up per token."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype, device) -> None:
        dim = config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        inv_freq = 1.0 / (config.rope_theta**exponents)
        inv_freq = _scale_inv_freq(inv_freq, config)
        self.inv_freq = inv_freq  # float32; fused RoPE kernels build their own tables from it
        self.max_positions = max_positions
        t = torch.arange(max_positions, dtype=torch.int64).to(torch.float)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype).to(device)
        self.sin = emb.sin().to(dtype).to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's position, [T, 1, head_dim]: looked up once per step
        and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        return self.rotate(x, *self.tables(positions))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def _scale_inv_freq(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {scaling.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class DecoderLayer(msgspec.Struct):
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # q, k and v projections fused into one matmul
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up_weight: torch.Tensor  # gate and up projections fused into one matmul
    down_weight: torch.Tensor


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: TorchOps | None = None,
        quantized: dict[str, QuantizedWeight] | None = None,
    ) -> None:
        """quantized: the checkpoint's block-quantized linear weights by HF name (see
        `load_quantized_weights`), which the ops may multiply in place of `weights`' copies."""
        self.config = config
        self.dtype = dtype
        self.device = device
        # Norm, RoPE and SiLU-and-mul: plain torch unless fused kernels are given (CUDA).
        self.ops = ops or TorchOps()

        def w(name: str) -> torch.Tensor:
            return weights[name].to(dtype=dtype, device=device)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.layers = [self._layer(w, i) for i in range(config.num_layers)]
        self._store_linear_weights()
        for weight in self._linear_weights():
            self.ops.prepack(weight)
        if quantized:
            self._attach_quantized(quantized)
        self.rope = RotaryEmbedding(config, max_positions, dtype, device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    def _store_linear_weights(self) -> None:
        """Each linear weight in the form the ops want to hold it (TorchOps.stored_weight:
        on a CPU without bf16 dot products the kernels keep a float32 model's bf16-exact
        weights in bfloat16, half the bytes a decode step reads). A tied LM head gets its
        own copy then; the embedding keeps the model's dtype for its lookups."""
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        for layer in self.layers:
            for name in names:
                setattr(layer, name, self.ops.stored_weight(getattr(layer, name)))
        self.lm_head = self.ops.stored_weight(self.lm_head)

    def _linear_weights(self) -> list[torch.Tensor]:
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        return [getattr(layer, n) for layer in self.layers for n in names] + [self.lm_head]

    def _attach_quantized(self, quantized: dict[str, QuantizedWeight]) -> None:
        """Hand the ops the block-quantized rows behind each fused weight, where every part
        of it has them in one format."""
        parts = {
            "qkv_weight": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "o_weight": ["self_attn.o_proj"],
            "gate_up_weight": ["mlp.gate_proj", "mlp.up_proj"],
            "down_weight": ["mlp.down_proj"],
        }
        for i, layer in enumerate(self.layers):
            for attr, names in parts.items():
                found = [quantized.get(f"model.layers.{i}.{n}.weight") for n in names]
                self._attach(getattr(layer, attr), found)
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        self._attach(self.lm_head, [quantized.get(head)])

    def _attach(self, weight: torch.Tensor, found: list[QuantizedWeight | None]) -> None:
        if any(q is None for q in found) or len({q.kind for q in found}) != 1:
            return
        blocks = torch.cat([q.blocks for q in found])
        self.ops.attach_quantized(weight, QuantizedWeight(found[0].kind, blocks))

    def _layer(self, w, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([w(attn + f"{x}_proj.bias") for x in "qkv"])
        return DecoderLayer(
            input_norm=w(p + "input_layernorm.weight"),
            qkv_weight=torch.cat([w(attn + f"{x}_proj.weight") for x in "qkv"]),
            qkv_bias=bias,
            q_norm=w(attn + "q_norm.weight") if self.config.qk_norm else None,
            k_norm=w(attn + "k_norm.weight") if self.config.qk_norm else None,
            o_weight=w(attn + "o_proj.weight"),
            post_attention_norm=w(p + "post_attention_layernorm.weight"),
            gate_up_weight=torch.cat([w(mlp + "gate_proj.weight"), w(mlp + "up_proj.weight")]),
            down_weight=w(mlp + "down_proj.weight"),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: object,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states of every fed token, before the final norm: [T, hidden]. `embeds`:
        (rows, vectors) that replace those rows' token embeddings (a VLM's image tokens)."""
        h = F.embedding(input_ids, self.embed)
        if embeds is not None:
            h[embeds[0]] = embeds[1].to(h.dtype)
        rope_tables = self.ops.rope_tables(self.rope, positions)
        eps, last = self.config.rms_norm_eps, len(self.layers) - 1
        # x: the normed input of the next block; each residual add is fused with the norm
        # after it (one pass over the hidden states instead of two ops).
        x = self.ops.rms_norm(h, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            attn = self._attention(index, layer, x, (positions, rope_tables), backend, meta)
            x, h = self.ops.add_rms_norm(h, attn, layer.post_attention_norm, eps)
            mlp = self._mlp(layer, x)
            if index == last:
                return h + mlp
            x, h = self.ops.add_rms_norm(h, mlp, self.layers[index + 1].input_norm, eps)
        return h  # no layers

    def _attention(self, index, layer: DecoderLayer, x, rope_at, backend, meta) -> torch.Tensor:
        """x: the normed hidden states. rope_at: the step's positions and their rotary
        tables (see TorchOps.rope)."""
        c = self.config
        qkv = self.ops.linear(x, layer.qkv_weight, layer.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q = self.ops.rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = self.ops.rms_norm(k, layer.k_norm, c.rms_norm_eps)
        q, k = self.ops.rope(self.rope, q, k, *rope_at)
        o = backend.attend(index, q, k, v.contiguous(), meta)
        return self.ops.linear(o.reshape(-1, self.q_size), layer.o_weight)

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """x: the normed hidden states."""
        gate_up = self.ops.linear(x, layer.gate_up_weight)
        return self.ops.linear(self.ops.silu_and_mul(gate_up), layer.down_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows of `forward`'s output."""
        h = self.ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return self.ops.linear(h, self.lm_head).to(torch.float32)
