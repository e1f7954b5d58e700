"""The Llama family (Llama, Mistral, SmolLM) plus Qwen2 (q/k/v bias) and Qwen3 (q/k norm):
their config readers, tensor names and the model, which the mixture-of-experts families
(engine.models.moe) and Phi-3 extend.

Written against the attention-backend interface: the model sees a flattened batch of tokens
from many sequences (prefill chunks and decodes mixed) and never knows how the KV cache is
laid out. Weights come in with Hugging Face names (see `engine.layers.weights`); the math
follows transformers' implementation step for step, since it is our numerical reference.
"""

from __future__ import annotations

import msgspec
import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.layers.config import (
    HFConfig,
    LayerAttention,
    ModelConfig,
    config_from_gguf,
    config_from_hf,
    gguf_arch_value,
    layer_windows,
    require,
    whole_model_window,
)
from engine.layers.cpu_ops import CpuKernelOps
from engine.layers.gguf_weights import QuantizedWeight
from engine.layers.rotary import RotaryEmbedding
from engine.layers.torch_ops import TorchOps
from engine.layers.tp_group import SINGLE, TPGroup


class DecoderLayer(msgspec.Struct):
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # q, k and v projections fused into one matmul
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up_weight: torch.Tensor | None  # gate and up projections fused into one matmul
    down_weight: torch.Tensor | None
    moe: object | None = None  # a mixture-of-experts MLP instead (engine.models.moe)
    o_bias: torch.Tensor | None = None  # gpt-oss
    sinks: torch.Tensor | None = None  # gpt-oss: per-head logits joining the softmax


class LlamaModel:
    # Pure decode steps run each layer in one kernel call where they can (`_fused_blocks`);
    # False runs every op from Python (benchmarks/profile_decode.py --per-op, to see them).
    fuse_decode_layers = True

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        ops: TorchOps | None = None,
        quantized: dict[str, QuantizedWeight] | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        """quantized: the checkpoint's block-quantized linear weights by HF name (see
        `load_quantized_weights`), which the ops may multiply in place of `weights`' copies.
        tp: this rank's tensor-parallel group; `weights` and `config` are then its shard
        (engine.layers.sharding: its own heads, its part of the intermediate and of the
        vocabulary) and the blocks sum or gather across ranks where the math needs it."""
        self.config = config
        self.tp = tp
        self.vocab_start = tp.shard.vocab_range(config.vocab_size)[0] if tp.parallel else 0
        self.dtype = dtype
        self.device = device
        # Norm, RoPE and SiLU-and-mul: plain torch unless fused kernels are given (CUDA).
        self.ops = ops or TorchOps()

        def w(name: str) -> torch.Tensor:
            tensor = weights[name]
            if tensor.is_meta:  # an expert held only as the checkpoint's blocks: no bytes
                return tensor
            if tensor.dtype == torch.uint8:  # codes (MXFP4 blocks): the family reads them
                return tensor.to(device=device)
            return tensor.to(dtype=dtype, device=device)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.layers = [self._layer(w, i) for i in range(config.num_layers)]
        self._store_linear_weights()
        for weight in self._linear_weights():
            self.ops.prepack(weight)
        if quantized:
            self._attach_quantized(quantized)
        # An expert loaded as blocks only (load_weights' experts_as_blocks) has no other
        # weights: the ops must hold its blocks, or its first matmul would fail mid-serving.
        for i, layer in enumerate(self.layers):
            weights = layer.moe.linear_weights() if layer.moe is not None else []
            if any(w.is_meta and not self.ops.holds_blocks(w) for w in weights):
                raise ValueError(f"layer {i}'s experts were loaded as GGUF blocks, but the "
                                 f"{self.ops.name} ops do not hold their blocks")
        # The same for a GPTQ / AWQ / compressed-tensors checkpoint's linears.
        if any(w.is_meta and not self.ops.holds_blocks(w) for w in self._linear_weights()):
            raise ValueError(f"the checkpoint's quantized linears need blocks the "
                             f"{self.ops.name} ops do not hold")
        self.rope = RotaryEmbedding(config, max_positions, dtype, device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self._fused: tuple[int, list | None] | None = None  # (id(ops), _fused_blocks' answer)

    def _store_linear_weights(self) -> None:
        """Each linear weight in the form the ops want to hold it (TorchOps.stored_weight:
        on a CPU without bf16 dot products the kernels keep a float32 model's bf16-exact
        weights in bfloat16, half the bytes a decode step reads). A tied LM head gets its
        own copy then; the embedding keeps the model's dtype for its lookups."""
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        for layer in self.layers:
            for name in names:
                weight = getattr(layer, name)
                if weight is not None:  # an MoE layer has experts instead of one MLP
                    setattr(layer, name, self.ops.stored_weight(weight))
        self.lm_head = self.ops.stored_weight(self.lm_head)

    def _linear_weights(self) -> list[torch.Tensor]:
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        dense = [getattr(layer, n) for layer in self.layers for n in names]
        experts = [w for layer in self.layers if layer.moe for w in layer.moe.linear_weights()]
        return [w for w in dense if w is not None] + experts + [self.lm_head]

    def _attach_quantized(self, quantized: dict[str, QuantizedWeight]) -> None:
        """Hand the ops the block-quantized rows behind each fused weight, part by part,
        where every part has them (the parts' kinds may differ: Q4_K_M's q/k/v)."""
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
        if any(q is None for q in found):
            return
        self.ops.attach_quantized(weight, found)

    def _layer(self, w, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        return DecoderLayer(
            input_norm=w(p + "input_layernorm.weight"),
            qkv_weight=self._qkv_weight(w, attn),
            qkv_bias=self._qkv_bias(w, attn),
            q_norm=w(attn + "q_norm.weight") if self.config.qk_norm else None,
            k_norm=w(attn + "k_norm.weight") if self.config.qk_norm else None,
            o_weight=w(attn + "o_proj.weight"),
            post_attention_norm=w(p + "post_attention_layernorm.weight"),
            **self._mlp_fields(w, i),
        )

    def _qkv_weight(self, w, attn: str) -> torch.Tensor:
        return torch.cat([w(attn + f"{x}_proj.weight") for x in "qkv"])

    def _qkv_bias(self, w, attn: str) -> torch.Tensor | None:
        if not self.config.attention_bias:
            return None
        return torch.cat([w(attn + f"{x}_proj.bias") for x in "qkv"])

    def _mlp_fields(self, w, i: int) -> dict:
        """Layer i's MLP as DecoderLayer fields: here the dense gated one; the MoE
        families return `moe` instead."""
        mlp = f"model.layers.{i}.mlp."
        return dict(
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
        h = self._embed_tokens(input_ids)
        if embeds is not None:
            h[embeds[0]] = embeds[1].to(h.dtype)
        rope_at = (self.rope, positions, self.ops.rope_tables(self.rope, positions))
        eps, last = self.config.rms_norm_eps, len(self.layers) - 1
        # x: the normed input of the next block; each residual add is fused with the norm
        # after it (one pass over the hidden states instead of two ops).
        x = self.ops.rms_norm(h, self.layers[0].input_norm, eps)
        fused = self._fused_blocks(x, backend)
        for index, layer in enumerate(self.layers):
            attention = fused and backend.decode_kernel_inputs(index, meta)
            if attention:
                # The whole layer in one kernel call, the bits of the ops below.
                c, after = self.config, self.layers[index + 1].input_norm if index < last else None
                out = self.ops.decode_layer(
                    x, h, fused[index], layer.post_attention_norm, after, eps, self.rope,
                    positions.contiguous(), c.num_heads, c.num_kv_heads, attention)
                if index == last:
                    return out[0]
                x, h = out
                continue
            attn = self._attention(index, layer, x, rope_at, backend, meta)
            x, h = self.ops.add_rms_norm(h, attn, layer.post_attention_norm, eps)
            mlp = self._mlp(layer, x)
            if index == last:
                return h + mlp
            x, h = self.ops.add_rms_norm(h, mlp, self.layers[index + 1].input_norm, eps)
        return h  # no layers

    def _fused_blocks(self, x: torch.Tensor, backend) -> list | None:
        """Each layer's blocks for CpuKernelOps.decode_layer where this step's rows may run
        every layer in one call, else None: the CPU kernels' ops (not LoRA's), row counts
        they multiply by the blocks, a backend with the decode kernel, and layers that are
        exactly this class's math (no q/k/v or o bias, q/k norm, sinks, experts, tensor
        parallelism, partial rotary, layers without rotary) with every linear over blocks.
        Whether the step is a pure decode the backend says per layer
        (`decode_kernel_inputs`)."""
        ops = self.ops
        if (not self.fuse_decode_layers or not isinstance(ops, CpuKernelOps)
                or not ops.takes_decode_layer(x)
                or getattr(backend, "decode_kernel_inputs", None) is None):
            return None
        if self._fused is None or self._fused[0] != id(ops):
            self._fused = (id(ops), self._layer_blocks(ops))
        return self._fused[1]

    def _layer_blocks(self, ops: CpuKernelOps) -> list | None:
        model = type(self)
        same_math = all(getattr(model, name) is getattr(LlamaModel, name)
                        for name in ("forward", "_attention", "_mlp", "_activation"))
        c = self.config
        if (not same_math or self.tp.parallel or c.qk_norm or c.attention_bias or c.nope_layers
                or self.rope.cos.dtype != self.dtype or self.rope.cos.shape[-1] != c.head_dim):
            return None
        blocks = []
        for layer in self.layers:
            if (layer.moe is not None or layer.qkv_bias is not None or layer.o_bias is not None
                    or layer.sinks is not None or layer.q_norm is not None):
                return None
            found = ops.layer_blocks([layer.qkv_weight, layer.o_weight, layer.gate_up_weight,
                                      layer.down_weight])
            if found is None:
                return None
            blocks.append(found)
        return blocks

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; vocab-parallel, each rank looks up the ids in its part (zero
        elsewhere) and one all-reduce puts the rows together."""
        if not self.tp.parallel:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0.0))

    def _attention(self, index, layer: DecoderLayer, x, rope_at, backend, meta) -> torch.Tensor:
        """x: the normed hidden states. rope_at: the layer's rotary embedding, the step's
        positions and their rotary tables (see TorchOps.rope)."""
        c = self.config
        qkv = self.ops.linear(x, layer.qkv_weight, layer.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q = self.ops.rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = self.ops.rms_norm(k, layer.k_norm, c.rms_norm_eps)
        rope, positions, tables = rope_at
        if index not in c.nope_layers:
            q, k = self.ops.rope(rope, q, k, positions, tables)
        # Only a layer with sinks passes them: backends without sinks take no such argument.
        sinks = {} if layer.sinks is None else {"sinks": layer.sinks}
        o = backend.attend(index, q, k, v.contiguous(), meta, **sinks)
        # Row-parallel o_proj: each rank's heads give a partial sum of the output.
        out = self.ops.linear(o.reshape(-1, self.q_size), layer.o_weight, layer.o_bias)
        return self.tp.all_reduce(out)

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
        """x: the normed hidden states."""
        if layer.moe is not None:
            # Each expert's down projection is row-parallel too: one sum for the block.
            return self.tp.all_reduce(layer.moe(x, self.ops))
        gate_up = self.ops.linear(x, layer.gate_up_weight)
        down = self.ops.linear(self._activation(gate_up), layer.down_weight)
        return self.tp.all_reduce(down)  # row-parallel down_proj: partial sums

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2 * inter] gate then up -> [n, inter]: SwiGLU (Gemma's GeGLU overrides it)."""
        return self.ops.silu_and_mul(gate_up)

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """`forward`'s rows after the final norm: what a pooling runner pools (HF's
        last_hidden_state)."""
        return self.ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the given rows of `forward`'s output."""
        h = self.ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        logits = self.ops.linear(h, self.lm_head).to(torch.float32)
        # Vocab-parallel LM head: every rank's slice of the vocabulary, gathered once.
        return self.tp.gather_last(logits, self.config.vocab_size)


# --- the family: config.json keys and tensor names ---------------------------------------------

# HF config-class defaults for keys a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}


def read_llama_config(raw: bytes) -> ModelConfig:
    """Llama and Mistral (Mistral is Llama with a sliding window in its v0.1)."""
    hf = msgspec.json.decode(raw, type=HFConfig)
    max_positions = hf.max_position_embeddings or _DEFAULT_MAX_POSITIONS["llama"]
    _check_dense_features(hf)
    # For llama attention_bias also adds an o_proj bias, which we do not implement.
    require(not hf.attention_bias, "attention_bias", "an o_proj bias is not implemented")
    # Mistral v0.1 sets sliding_window without a use_ flag; Llama's config has no window.
    layers = whole_model_window(hf, max_positions) if hf.model_type == "mistral" else ()
    return config_from_hf(hf, "llama", max_positions, layer_attention=layers)


def read_qwen2_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=HFConfig)
    _check_dense_features(hf)
    require(not hf.use_sliding_window, "use_sliding_window", "not implemented for Qwen2")
    # Qwen2 always has q/k/v biases; its attention_bias key is not consulted by HF either.
    return config_from_hf(hf, "qwen2", _DEFAULT_MAX_POSITIONS["qwen2"], attention_bias=True)


def read_qwen3_config(raw: bytes) -> ModelConfig:
    hf = msgspec.json.decode(raw, type=HFConfig)
    _check_dense_features(hf)
    require(not hf.attention_bias, "attention_bias", "an o_proj bias is not implemented")
    require(not hf.use_sliding_window, "use_sliding_window", "not implemented for Qwen3")
    return config_from_hf(hf, "qwen3", _DEFAULT_MAX_POSITIONS["qwen3"], qk_norm=True)


class _SmolLM3HF(HFConfig):
    no_rope_layers: list[int] | None = None  # per layer: 1 rotary, 0 none (NoPE)
    no_rope_layer_interval: int = 4  # without the list: every interval-th layer is NoPE


def read_smollm3_config(raw: bytes) -> ModelConfig:
    """SmolLM3: Llama with no rotary embedding in some layers (every 4th by default), and
    a sliding window on those NoPE layers where use_sliding_window says so."""
    hf = msgspec.json.decode(raw, type=_SmolLM3HF)
    _check_dense_features(hf)
    require(not hf.attention_bias, "attention_bias", "not implemented for SmolLM3")
    layers = hf.num_hidden_layers
    if hf.no_rope_layers is None:
        require(hf.no_rope_layer_interval >= 1, "no_rope_layer_interval",
                f"{hf.no_rope_layer_interval} is not a positive interval")
        hf.no_rope_layers = [int((i + 1) % hf.no_rope_layer_interval != 0)
                             for i in range(layers)]
    require(len(hf.no_rope_layers) == layers and set(hf.no_rope_layers) <= {0, 1},
            "no_rope_layers", f"needs one 0 or 1 per layer ({layers})")
    nope = tuple(i for i, rotary in enumerate(hf.no_rope_layers) if not rotary)
    max_positions = hf.max_position_embeddings or 32768
    attention: tuple[LayerAttention, ...] = ()
    if hf.use_sliding_window and hf.sliding_window is not None:
        # transformers' default: the NoPE layers slide; a saved layer_types says which.
        if hf.layer_types is None:
            hf.layer_types = ["sliding_attention" if i in nope else "full_attention"
                              for i in range(layers)]
        attention = tuple(LayerAttention(window=w)
                          for w in layer_windows(hf, max_positions))
    return config_from_hf(hf, "smollm3", max_positions, nope_layers=nope,
                          layer_attention=attention)


def _check_dense_features(hf: HFConfig) -> None:
    """Refuse variants the engine would silently compute wrongly."""
    require(hf.hidden_act == "silu", "hidden_act",
            f"{hf.hidden_act!r} is not implemented (only silu)")
    require(not hf.mlp_bias, "mlp_bias", "MLP biases are not implemented")


def read_llama_gguf(reader) -> ModelConfig:
    # llama.cpp writes Mixtral as "llama" with experts, named its own way: not read yet.
    if gguf_arch_value(reader, "expert_count", 0):
        raise ValueError("GGUF llama.expert_count: mixture-of-experts llama files (Mixtral) "
                         "are not supported; serve the HF folder")
    return config_from_gguf(reader)


def read_qwen2_gguf(reader) -> ModelConfig:
    return config_from_gguf(reader, attention_bias=True)


def read_qwen3_gguf(reader) -> ModelConfig:
    return config_from_gguf(reader, qk_norm=True)


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with HF's shape."""
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.norm.weight": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for i in range(config.num_layers):
        layer = attention_shapes(config) | mlp_shapes(config)
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One layer's norms and attention tensors, relative to model.layers.{i}."""
    hidden = config.hidden_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "post_attention_layernorm.weight": (hidden,),
    }
    if config.attention_bias:
        shapes.update(
            {
                "self_attn.q_proj.bias": (q_out,),
                "self_attn.k_proj.bias": (kv_out,),
                "self_attn.v_proj.bias": (kv_out,),
            }
        )
    if config.qk_norm:
        shapes["self_attn.q_norm.weight"] = (config.head_dim,)
        shapes["self_attn.k_norm.weight"] = (config.head_dim,)
    return shapes


def mlp_shapes(config: ModelConfig, prefix: str = "mlp.", inter: int | None = None
               ) -> dict[str, tuple[int, ...]]:
    """A dense gated MLP's tensors under `prefix` (width `inter`, the config's default)."""
    hidden, inter = config.hidden_size, inter or config.intermediate_size
    return {
        f"{prefix}gate_proj.weight": (inter, hidden),
        f"{prefix}up_proj.weight": (inter, hidden),
        f"{prefix}down_proj.weight": (hidden, inter),
    }
