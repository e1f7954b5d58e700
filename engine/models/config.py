"""Model configuration for the engine's own Llama-family implementation.

One frozen `ModelConfig` describes every supported checkpoint, whether it comes from a GGUF
file or a Hugging Face folder, so the model code never looks at either format's metadata.
"""

import functools
import os

import gguf
import msgspec

ARCHITECTURES = ("llama", "qwen2", "qwen3")

# HF model_type -> our architecture; mistral is llama with a different name.
_HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# HF config-class defaults for keys a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
_DEFAULT_ROPE_THETA = 10000.0


class RopeScaling(msgspec.Struct, frozen=True):
    """RoPE frequency scaling; only the two kinds the engine implements."""

    rope_type: str  # "linear" | "llama3"
    factor: float
    # llama3 only: the band edges and the context length the scaling is relative to.
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}")
        llama3_fields = (
            self.low_freq_factor,
            self.high_freq_factor,
            self.original_max_position_embeddings,
        )
        if self.rope_type == "llama3" and None in llama3_fields:
            raise ValueError("llama3 rope scaling needs low/high_freq_factor and original length")


class ModelConfig(msgspec.Struct, frozen=True):
    architecture: str  # "llama" | "qwen2" | "qwen3"
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
    # A vision-language model (req T-13): its family ("idefics3") and the token id whose
    # positions take the vision encoder's outputs; None for a text-only model.
    multimodal: str | None = None
    image_token_id: int | None = None


# Vision-language model types -> the text model their config.json nests (text_config).
_MULTIMODAL_MODEL_TYPES = ("idefics3",)


def load_model_config(model_path: str) -> ModelConfig:
    """Read the config of a `.gguf` file or of an HF folder holding config.json."""
    if model_path.endswith(".gguf"):
        return _config_from_gguf(gguf_reader(model_path))
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{model_path!r} is neither a .gguf file nor a folder with config.json")
    with open(config_file, "rb") as f:
        raw = f.read()
    outer = msgspec.json.decode(raw, type=_HFOuterConfig)
    if outer.model_type in _MULTIMODAL_MODEL_TYPES:
        return _multimodal_config(outer)
    return _config_from_hf(msgspec.json.decode(raw, type=_HFConfig))


class _HFOuterConfig(msgspec.Struct):
    """A config.json's top: enough to tell a vision-language model and find its text side."""

    model_type: str = ""
    text_config: dict | None = None
    image_token_id: int | None = None
    tie_word_embeddings: bool | None = None


def _multimodal_config(outer: _HFOuterConfig) -> ModelConfig:
    """Idefics3 / SmolVLM: a Llama text model (ours) behind a vision encoder (engine.models
    .idefics3); the text side is read from text_config."""
    if outer.text_config is None or outer.image_token_id is None:
        raise ValueError(f"{outer.model_type} config.json lacks text_config or image_token_id")
    text = dict(outer.text_config)
    text.setdefault("model_type", "llama")
    if outer.tie_word_embeddings is not None:  # the top-level flag is the one HF ties by
        text["tie_word_embeddings"] = outer.tie_word_embeddings
    config = _config_from_hf(msgspec.convert(text, _HFConfig))
    if config.architecture != "llama":
        raise ValueError(f"{outer.model_type} with a {text['model_type']} text model is not "
                         "supported")
    return msgspec.structs.replace(config, multimodal=outer.model_type,
                                   image_token_id=outer.image_token_id)


@functools.lru_cache(maxsize=1)
def gguf_reader(path: str) -> gguf.GGUFReader:
    """Open a GGUF file once per process.

    Building the reader parses every metadata field, tokenizer vocabulary included, which takes
    seconds; config, weights and tokenizer loading all need it, so they share one reader.
    """
    return gguf.GGUFReader(path)


# --- Hugging Face folders ---------------------------------------------------------------------


class _HFConfig(msgspec.Struct):
    """The config.json keys we read; defaults are the HF config classes' own."""

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


def _config_from_hf(hf: _HFConfig) -> ModelConfig:
    arch = _HF_MODEL_TYPES.get(hf.model_type)
    if arch is None:
        raise ValueError(
            f"unsupported model_type {hf.model_type!r}; supported: {sorted(_HF_MODEL_TYPES)}"
        )
    max_positions = hf.max_position_embeddings or _DEFAULT_MAX_POSITIONS[arch]
    _check_hf_features(hf, arch, max_positions)
    rope_theta, rope_scaling = _hf_rope(hf)
    return ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=hf.head_dim or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=hf.tie_word_embeddings,
        # Qwen2 always has q/k/v biases; its attention_bias key is not consulted by HF either.
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        rope_scaling=rope_scaling,
    )


def _check_hf_features(hf: _HFConfig, arch: str, max_positions: int) -> None:
    """Refuse variants the engine would silently compute wrongly."""
    if hf.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hf.hidden_act!r}; only silu is implemented")
    # For llama and qwen3 attention_bias also adds an o_proj bias, which we do not implement.
    if hf.mlp_bias or (hf.attention_bias and arch != "qwen2"):
        raise ValueError(f"{hf.model_type} with attention_bias/mlp_bias is not supported")
    # Mistral v0.1 sets sliding_window without a use_ flag; it only matters below max length.
    window = hf.sliding_window if hf.model_type == "mistral" else None
    if hf.use_sliding_window or (window is not None and window < max_positions):
        raise ValueError("sliding-window attention is not supported")


def _hf_rope(hf: _HFConfig) -> tuple[float, RopeScaling | None]:
    params = dict(hf.rope_parameters or hf.rope_scaling or {})
    theta = params.pop("rope_theta", None) or hf.rope_theta or _DEFAULT_ROPE_THETA
    # Older configs spell the kind "type"; "default" means no scaling.
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if rope_type == "default":
        return float(theta), None
    return float(theta), msgspec.convert({**params, "rope_type": rope_type}, RopeScaling)


# --- GGUF files -------------------------------------------------------------------------------


def _config_from_gguf(reader: gguf.GGUFReader) -> ModelConfig:
    arch = _gguf_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {ARCHITECTURES}")
    meta = functools.partial(_gguf_arch_value, reader, arch)
    tensor_names = {t.name for t in reader.tensors}
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    return ModelConfig(
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
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        rope_scaling=_gguf_rope_scaling(meta, tensor_names),
    )


def _gguf_rope_scaling(meta, tensor_names: set[str]) -> RopeScaling | None:
    # llama.cpp bakes llama3 scaling into per-frequency factors; their source parameters are
    # lost, and ignoring the factors would shift every rotary frequency.
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF rope_freqs (llama3-style scaling) is not supported")
    kind = meta("rope.scaling.type", "none")
    if kind == "none":
        return None
    return RopeScaling(rope_type=kind, factor=float(meta("rope.scaling.factor")))


_MISSING = object()


def _gguf_arch_value(reader: gguf.GGUFReader, arch: str, key: str, default=_MISSING):
    return _gguf_value(reader, f"{arch}.{key}", default)


def _gguf_value(reader: gguf.GGUFReader, key: str, default=_MISSING):
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _MISSING:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return default


def _gguf_embedding_rows(reader: gguf.GGUFReader) -> int:
    # ggml lists dimensions innermost first, so the vocabulary is the last one.
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return int(embedding.shape[-1])
