"""Model configuration: one frozen `ModelConfig` for every supported checkpoint.

Whether it comes from a GGUF file or a Hugging Face folder, the model code never looks at
either format's metadata. Which family reads a config.json (and so which model class runs
it) is `engine.models.registry`'s choice; the families' readers build their ModelConfig
with `config_from_hf` over the keys every decoder shares (`HFConfig`).
"""

import functools

import msgspec
import numpy as np

from shared.gguf_file import GGUFFile

_DEFAULT_ROPE_THETA = 10000.0

# "freq_factors": per-frequency divisors as a GGUF file stores them (llama.cpp's rope_freqs
# tensor, which is how it writes Llama 3's scaling).
ROPE_TYPES = ("linear", "llama3", "yarn", "longrope", "freq_factors")


class RopeScaling(msgspec.Struct, frozen=True):
    """RoPE frequency scaling; only the kinds the engine implements (ROPE_TYPES)."""

    rope_type: str
    factor: float | None = None
    # llama3 only: the band edges and the context length the scaling is relative to.
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    # yarn: the ramp's edges (in rotations), its rounding, and the cos/sin scale.
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    # longrope (Phi-3 "su"): per-frequency divisors below / past the original length.
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # freq_factors: each rotary frequency divided by its factor.
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; "
                             f"supported: {ROPE_TYPES}")
        needs = {
            "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings"),
            "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
            "freq_factors": ("freq_factors",),
        }[self.rope_type]
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{self.rope_type} rope scaling needs {', '.join(missing)}")


class LayerAttention(msgspec.Struct, frozen=True):
    """How one layer attends, where it differs from plain causal attention over the whole
    context with scale head_dim ** -0.5 (the default value of every field)."""

    window: int | None = None  # a query sees itself and the window - 1 tokens before it
    scale: float | None = None  # the score scale; None: head_dim ** -0.5
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    sinks: bool = False  # a learned per-head logit joins the softmax (gpt-oss)
    # Chunked local attention (Llama 4): a query sees the keys of its own chunk of this many
    # positions only (0..chunk-1, chunk..2*chunk-1, ...), causally.
    chunk: int | None = None


PLAIN_ATTENTION = LayerAttention()


class MoeConfig(msgspec.Struct, frozen=True):
    """A mixture-of-experts MLP: each token through its top-k of num_experts gated MLPs."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # Routing: softmax over all experts then top-k ("softmax_topk"), optionally renormalised
    # over the chosen k; or top-k over the logits, then softmax over those k ("topk_softmax").
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    # Qwen2-MoE: one always-on expert of this width, scaled by sigmoid(its gate); 0: none.
    shared_expert_intermediate_size: int = 0
    # Layers whose MLP is a plain dense one (Qwen-MoE's mlp_only_layers / sparse step).
    dense_layers: tuple[int, ...] = ()


class MlaConfig(msgspec.Struct, frozen=True):
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one latent
    per token, kv_lora_rank wide, plus a rotary key part shared by every head; the KV cache
    holds those two (latent_width) instead of per-head K and V."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: one q_proj, no low-rank q
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale_all_dim squared

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


class ModelConfig(msgspec.Struct, frozen=True):
    architecture: str  # the family's name in engine.models.registry
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm on q and k per head
    rope_scaling: RopeScaling | None = None
    # Rotary over only the first rotary_dim dims of each head (partial_rotary_factor);
    # None: over the whole head.
    rotary_dim: int | None = None
    # Layers that apply no rotary embedding to q and k (SmolLM3's NoPE layers).
    nope_layers: tuple[int, ...] = ()
    # A vision-language model (req T-13): its family ("idefics3") and the token id whose
    # positions take the vision encoder's outputs; None for a text-only model.
    multimodal: str | None = None
    image_token_id: int | None = None
    moe: MoeConfig | None = None
    # One entry per layer where any layer attends other than plainly; empty: none does.
    layer_attention: tuple[LayerAttention, ...] = ()
    # A family's own settings (a msgspec Struct its module defines), None for most.
    family_options: msgspec.Struct | None = None
    mla: MlaConfig | None = None  # latent attention: the cache holds latents, not K/V

    def kv_elements_per_token(self) -> int:
        """Cache elements one token takes over all layers: its latent with MLA, else K and
        V of every KV head."""
        if self.mla is not None:
            return self.num_layers * self.mla.latent_width
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def attention_of(self, layer: int) -> LayerAttention:
        return self.layer_attention[layer] if self.layer_attention else PLAIN_ATTENTION

    @property
    def kv_window(self) -> int | None:
        """The longest sliding window when every layer has one (Mistral v0.1, Mixtral, a
        windowed Phi-3): K/V further back than that is never read again, so the scheduler
        releases its pages. None when any layer attends the whole context (Gemma, gpt-oss)."""
        windows = [self.attention_of(i).window for i in range(self.num_layers)]
        if not windows or None in windows:
            return None
        return max(windows)


@functools.lru_cache(maxsize=1)
def gguf_reader(path: str) -> GGUFFile:
    """Open a GGUF file once per process: config and weights loading share one reader."""
    return GGUFFile(path)


# --- Hugging Face folders ---------------------------------------------------------------------


class HFConfig(msgspec.Struct):
    """The config.json keys every decoder family shares; defaults are the HF config classes'
    own. A family reads its own keys with a subclass."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    # transformers < 5 writes rope_theta + rope_scaling; 5.x folds both into rope_parameters.
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    use_sliding_window: bool = False
    layer_types: list[str] | None = None
    # transformers < 5 writes it at the top level; 5.x inside rope_parameters.
    partial_rotary_factor: float | None = None


def config_from_hf(hf: HFConfig, architecture: str, default_max_positions: int,
                   rope: dict | None = None, **fields) -> ModelConfig:
    """The ModelConfig of the shared keys; `fields` set or override the rest. rope: the
    rotary parameters when not the config's top-level ones (Gemma 3's per layer type)."""
    params = rope if rope is not None else hf_rope_parameters(hf)
    theta, scaling = hf_rope(params)
    max_positions = hf.max_position_embeddings or default_max_positions
    head_dim = hf.head_dim or hf.hidden_size // hf.num_attention_heads
    base = dict(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=head_dim,
        rotary_dim=_rotary_dim(hf, params, head_dim),
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=hf.tie_word_embeddings,
        rope_scaling=scaling,
    )
    return ModelConfig(**(base | fields))


def require(condition: bool, key: str, why: str) -> None:
    """Refuse a config.json whose `key` asks for what the engine does not compute."""
    if not condition:
        raise ValueError(f"config.json {key}: {why}")


def hf_rope_parameters(hf: HFConfig) -> dict:
    params = dict(hf.rope_parameters or hf.rope_scaling or {})
    params.setdefault("rope_theta", hf.rope_theta or _DEFAULT_ROPE_THETA)
    return params


def _rotary_dim(hf: HFConfig, params: dict, head_dim: int) -> int | None:
    """How many leading dims of each head rotate (Phi-4-mini: 3/4 of them); None: all."""
    factor = params.get("partial_rotary_factor", hf.partial_rotary_factor)
    if factor is None or factor == 1.0:
        return None
    dim = int(head_dim * factor)
    require(0 < factor < 1 and dim > 0 and dim % 2 == 0, "partial_rotary_factor",
            f"{factor} gives {dim} of {head_dim} head dims, not an even count in (0, head_dim]")
    return dim


def hf_rope(params: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one rotary parameter dict, in either transformers' spelling."""
    params = dict(params)
    theta = params.pop("rope_theta", None) or _DEFAULT_ROPE_THETA
    # Older configs spell the kind "type" (and Phi-3's longrope "su"); "default": no scaling.
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)
    params.pop("partial_rotary_factor", None)  # read by _rotary_dim
    if rope_type == "default":
        return float(theta), None
    known = set(RopeScaling.__struct_fields__)
    fields = {k: v for k, v in params.items() if k in known}
    return float(theta), msgspec.convert({**fields, "rope_type": rope_type}, RopeScaling)


def whole_model_window(hf: HFConfig, max_positions: int) -> tuple[LayerAttention, ...]:
    """The layer attention of a model whose `sliding_window`, where set, windows every layer
    (Mistral v0.1, Mixtral, Phi-3). A window as long as the context never engages, so it is
    none (Phi-3-mini-128k sets 262144 over a 131072 context)."""
    window = hf.sliding_window
    if window is None or window >= max_positions:
        return ()
    require(window > 0, "sliding_window", f"{window} is not a positive window")
    return (LayerAttention(window=window),) * hf.num_hidden_layers


def layer_windows(hf: HFConfig, max_positions: int) -> list[int | None]:
    """Each layer's sliding window from `layer_types` and `sliding_window` (None: full
    attention). A window must be positive and within the model's context."""
    types = hf.layer_types or ["full_attention"] * hf.num_hidden_layers
    require(len(types) == hf.num_hidden_layers, "layer_types",
            f"{len(types)} entries for {hf.num_hidden_layers} layers")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    require(not unknown, "layer_types", f"unsupported layer types {unknown}")
    if "sliding_attention" not in types:
        return [None] * len(types)
    window = hf.sliding_window
    require(window is not None and 0 < window <= max_positions, "sliding_window",
            f"{window} is not a window within the context (1..{max_positions})")
    return [window if t == "sliding_attention" else None for t in types]


# --- GGUF files -------------------------------------------------------------------------------


def gguf_architecture(reader: GGUFFile) -> str:
    return _gguf_value(reader, "general.architecture")


def config_from_gguf(reader: GGUFFile, **fields) -> ModelConfig:
    """The ModelConfig of a GGUF file's llama-style metadata; `fields` set what the metadata
    does not say (e.g. attention_bias) or name the family where it differs from the file's
    architecture."""
    arch = gguf_architecture(reader)
    meta = functools.partial(_gguf_arch_value, reader, arch)
    tensor_names = {t.name for t in reader.tensors}
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    base = dict(
        architecture=arch,
        vocab_size=meta("vocab_size", None) or _gguf_embedding_rows(reader),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv", None) or heads,
        head_dim=meta("attention.key_length", None)
        or meta("rope.dimension_count", None)
        or hidden // heads,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", _DEFAULT_ROPE_THETA)),
        max_position_embeddings=meta("context_length"),
        # llama.cpp writes no output.weight when the head shares the embedding matrix.
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_gguf_rope_scaling(reader, meta, tensor_names),
    )
    return ModelConfig(**(base | fields))


def _gguf_rope_scaling(reader, meta, tensor_names: set[str]) -> RopeScaling | None:
    kind = meta("rope.scaling.type", "none")
    # llama.cpp bakes Llama 3's scaling into per-frequency divisors (the rope_freqs tensor,
    # which it applies on top of any rope.scaling); we read the divisors as they are.
    if "rope_freqs.weight" in tensor_names:
        if kind not in ("none", "linear") or float(meta("rope.scaling.factor", 1.0)) != 1.0:
            raise ValueError(f"GGUF rope_freqs beside rope.scaling.type {kind!r} is not "
                             "supported")
        return RopeScaling(rope_type="freq_factors",
                           freq_factors=gguf_tensor_values(reader, "rope_freqs.weight"))
    if kind == "none":
        return None
    if kind == "yarn":  # llama.cpp's defaults for the ramp's edges are transformers' too
        return RopeScaling(
            rope_type=kind, factor=float(meta("rope.scaling.factor")),
            original_max_position_embeddings=meta("rope.scaling.original_context_length"),
            beta_fast=float(meta("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(meta("rope.scaling.yarn_beta_slow", 1.0)))
    return RopeScaling(rope_type=kind, factor=float(meta("rope.scaling.factor")))


_MISSING = object()


def gguf_arch_value(reader: GGUFFile, key: str, default=_MISSING):
    """The `{architecture}.{key}` metadata of a GGUF file (ValueError naming it if absent
    and no default is given)."""
    return _gguf_arch_value(reader, gguf_architecture(reader), key, default)


def _gguf_arch_value(reader: GGUFFile, arch: str, key: str, default=_MISSING):
    return _gguf_value(reader, f"{arch}.{key}", default)


def _gguf_value(reader: GGUFFile, key: str, default=_MISSING):
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _MISSING:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return default


def gguf_tensor_values(reader: GGUFFile, name: str) -> tuple[float, ...] | None:
    """A small float tensor a GGUF file stores as configuration (rope factors), or None."""
    for tensor in reader.tensors:
        if tensor.name == name:
            return tuple(float(v) for v in np.asarray(tensor.data, dtype=np.float32).ravel())
    return None


def _gguf_embedding_rows(reader: GGUFFile) -> int:
    # ggml lists dimensions innermost first, so the vocabulary is the last one.
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embedding.shape[-1])
