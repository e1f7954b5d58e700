"""The model registry: which family serves a checkpoint, and the one place that says so.

A family is one module under engine/models/ (its config reader, tensor names and model
class, over the shared blocks: engine.layers.rotary, engine.models.moe, the ops and the
attention-backend interface) plus its `Family` entry here. config.json's `architectures`
(else its `model_type`) or a GGUF file's `general.architecture` picks the entry; a checkpoint
no entry names is refused at start with the list of what is served.

The entry points that need the family are here too: `load_model_config` (which family reads
the checkpoint's config), `load_weights`, `load_quantized_weights` and `expected_shapes`
(engine.layers.weights reads the tensors under the names the family gives it as data).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec
import torch

from engine.layers import weights
from engine.layers.checkpoint_names import GGUF_LAYER_NAMES, CheckpointNames
from engine.layers.config import ModelConfig, gguf_architecture, gguf_reader
from engine.layers.gguf_weights import QuantizedWeight
from engine.models import (
    bert,
    deepseek,
    deepseek_gguf,
    gemma,
    glm4_moe,
    gpt_oss,
    idefics3,
    llama,
    llama4,
    moe,
    phi3,
)


class Family(msgspec.Struct, frozen=True):
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]  # config.json `architectures` entries it reads
    hf_model_types: tuple[str, ...]  # config.json `model_type`s it reads
    read_hf_config: Callable[[bytes], ModelConfig]  # config.json's bytes -> ModelConfig
    tensor_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # by HF name
    # (config, weights, max_positions, dtype, device, ops=, quantized=) -> the model
    model_class: type
    gguf_architectures: tuple[str, ...] = ()
    read_gguf_config: Callable | None = None  # GGUFReader -> ModelConfig
    # llama.cpp block tensor names that mean something else in this family than in Llama's
    # (engine.layers.weights), e.g. Phi-3's fused attn_qkv.
    gguf_layer_names: dict[str, str] = msgspec.field(default_factory=dict)
    # (GGUF name -> dequantized array, GGUF name -> HF name or None) -> HF name -> array: for
    # a family whose GGUF tensors are grouped otherwise than its checkpoint's (gpt-oss).
    gguf_tensors: Callable | None = None
    # config -> (a safetensors name -> the model's name, or None for one it does not use),
    # for a family whose checkpoints prefix their names (bert.): None, the names are HF's.
    checkpoint_names: Callable | None = None


# A bare `*Model` architecture is the same network without its LM head: an embedding
# checkpoint, served by the pooling runner (shared.runner_config).
FAMILIES = (
    Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "LlamaModel", "MistralModel"),
           ("llama", "mistral"),
           llama.read_llama_config, llama.tensor_shapes, llama.LlamaModel,
           ("llama",), llama.read_llama_gguf),
    Family("qwen2", ("Qwen2ForCausalLM", "Qwen2Model"), ("qwen2",), llama.read_qwen2_config,
           llama.tensor_shapes, llama.LlamaModel, ("qwen2",), llama.read_qwen2_gguf),
    Family("qwen3", ("Qwen3ForCausalLM", "Qwen3Model"), ("qwen3",), llama.read_qwen3_config,
           llama.tensor_shapes, llama.LlamaModel, ("qwen3",), llama.read_qwen3_gguf),
    Family("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), llama.read_smollm3_config,
           llama.tensor_shapes, llama.LlamaModel),
    # A vision encoder before a Llama text model: read as the text model (architecture
    # "llama") marked multimodal; the encoder loads beside it (engine.models.idefics3).
    Family("idefics3", ("Idefics3ForConditionalGeneration",), ("idefics3",),
           idefics3.read_idefics3_config, llama.tensor_shapes, llama.LlamaModel),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), moe.read_qwen2_moe_config,
           moe.tensor_shapes, moe.MoeModel, ("qwen2moe",), moe.read_qwen2_moe_gguf),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), moe.read_qwen3_moe_config,
           moe.tensor_shapes, moe.MoeModel, ("qwen3moe",), moe.read_qwen3_moe_gguf),
    Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), moe.read_mixtral_config,
           moe.mixtral_tensor_shapes, moe.MixtralModel),
    Family("gemma", ("GemmaForCausalLM",), ("gemma",), gemma.read_gemma_config,
           gemma.tensor_shapes, gemma.GemmaModel, ("gemma",), gemma.read_gemma_gguf),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), gemma.read_gemma2_config,
           gemma.tensor_shapes, gemma.GemmaModel, ("gemma2",), gemma.read_gemma2_gguf,
           gemma.GGUF_LAYER_NAMES),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), gemma.read_gemma3_config,
           gemma.tensor_shapes, gemma.GemmaModel, ("gemma3",), gemma.read_gemma3_gguf,
           gemma.GGUF_LAYER_NAMES),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), phi3.read_phi3_config,
           phi3.tensor_shapes, phi3.Phi3Model, ("phi3",), phi3.read_phi3_gguf,
           phi3.GGUF_LAYER_NAMES),
    # Encoders (engine.models.bert): served by the pooling runner only.
    Family("bert", ("BertModel", "BertForSequenceClassification"), ("bert",),
           bert.read_bert_config, bert.tensor_shapes, bert.BertModel,
           checkpoint_names=bert.checkpoint_names),
    Family("roberta", ("RobertaModel", "XLMRobertaModel", "RobertaForSequenceClassification",
                       "XLMRobertaForSequenceClassification"), ("roberta", "xlm-roberta"),
           bert.read_bert_config, bert.tensor_shapes, bert.BertModel,
           checkpoint_names=bert.checkpoint_names),
    Family("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), gpt_oss.read_gpt_oss_config,
           gpt_oss.tensor_shapes, gpt_oss.GptOssModel, ("gpt-oss",), gpt_oss.read_gpt_oss_gguf,
           gpt_oss.GGUF_LAYER_NAMES, gpt_oss.gguf_tensors),
    Family("glm4_moe", ("Glm4MoeForCausalLM",), ("glm4_moe",), glm4_moe.read_glm4_moe_config,
           glm4_moe.tensor_shapes, glm4_moe.Glm4MoeModel, ("glm4moe",),
           glm4_moe.read_glm4_moe_gguf, glm4_moe.GGUF_LAYER_NAMES, glm4_moe.gguf_tensors,
           checkpoint_names=glm4_moe.checkpoint_names),
    # Llama4ForConditionalGeneration: its text model only (no image input).
    Family("llama4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
           ("llama4_text", "llama4"), llama4.read_llama4_config, llama4.tensor_shapes,
           llama4.Llama4Model, ("llama4",), llama4.read_llama4_gguf, llama4.GGUF_LAYER_NAMES,
           llama4.gguf_tensors, checkpoint_names=llama4.checkpoint_names),
    # Multi-head latent attention (engine.attention.mla_backend) and DeepSeekMoE.
    # llama.cpp's deepseek2 files hold either (the reader names the config's family).
    Family("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",),
           deepseek.read_deepseek_v3_config, deepseek.tensor_shapes, deepseek.DeepseekModel,
           ("deepseek2",), deepseek_gguf.read_deepseek2_gguf, deepseek_gguf.GGUF_LAYER_NAMES,
           deepseek_gguf.gguf_tensors, deepseek.checkpoint_names),
    Family("deepseek_v2", ("DeepseekV2ForCausalLM",), ("deepseek_v2",),
           deepseek.read_deepseek_v2_config, deepseek.tensor_shapes, deepseek.DeepseekModel,
           (), None, deepseek_gguf.GGUF_LAYER_NAMES, deepseek_gguf.gguf_tensors,
           deepseek.checkpoint_names),
)

_BY_NAME = {f.name: f for f in FAMILIES}


def supported() -> list[str]:
    """config.json architectures the engine serves, for error messages and docs."""
    return sorted(a for f in FAMILIES for a in f.hf_architectures)


class _ConfigHead(msgspec.Struct):
    """The keys of a config.json that pick its family."""

    model_type: str = ""
    architectures: list[str] | None = None


def family_for_hf(raw: bytes) -> Family:
    head = msgspec.json.decode(raw, type=_ConfigHead)
    for arch in head.architectures or []:
        for family in FAMILIES:
            if arch in family.hf_architectures:
                return family
    for family in FAMILIES:
        if head.model_type in family.hf_model_types:
            return family
    raise ValueError(
        f"unsupported model: config.json architectures {head.architectures} / model_type "
        f"{head.model_type!r}; supported architectures: {', '.join(supported())}")


def config_from_hf(raw: bytes) -> ModelConfig:
    return family_for_hf(raw).read_hf_config(raw)


def config_from_gguf(reader) -> ModelConfig:
    arch = gguf_architecture(reader)
    for family in FAMILIES:
        if arch in family.gguf_architectures:
            return family.read_gguf_config(reader)
    served = sorted(a for f in FAMILIES for a in f.gguf_architectures)
    raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {served}")


def family_of(config: ModelConfig) -> Family:
    return _BY_NAME[config.architecture]


def build_model(config: ModelConfig, weights, max_positions: int, dtype, device, ops=None,
                quantized=None, tp=None):
    """The family's model over loaded weights (see engine.models.llama.LlamaModel); `tp`:
    a rank's tensor-parallel group, for the families engine.layers.sharding serves."""
    extra = {"tp": tp} if tp is not None and tp.parallel else {}
    return family_of(config).model_class(config, weights, max_positions, dtype, device,
                                         ops=ops, quantized=quantized, **extra)


def load_model_config(model_path: str) -> ModelConfig:
    """Read the config of a `.gguf` file or of an HF folder holding config.json; the family
    that reads it is picked here, and an unknown one refused."""
    if model_path.endswith(".gguf"):
        return config_from_gguf(gguf_reader(model_path))
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{model_path!r} is neither a .gguf file nor a folder with config.json")
    with open(config_file, "rb") as f:
        return config_from_hf(f.read())


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with HF's shape: its family's list."""
    return family_of(config).tensor_shapes(config)


def checkpoint_names(config: ModelConfig) -> CheckpointNames:
    """What the weight loaders need of the family, as data."""
    family = family_of(config)
    return CheckpointNames(
        expected_shapes(config), {**GGUF_LAYER_NAMES, **family.gguf_layer_names},
        family.gguf_tensors,
        family.checkpoint_names(config) if family.checkpoint_names is not None else None)


def load_weights(model_path: str, config: ModelConfig, dtype: torch.dtype,
                 **options) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name (engine.layers.weights.read_weights: `options`)."""
    return weights.read_weights(model_path, config, checkpoint_names(config), dtype, **options)


def load_quantized_weights(model_path: str, config: ModelConfig, shard=None
                           ) -> dict[str, QuantizedWeight]:
    """The linears the CPU kernels multiply as blocks: a GGUF's, or a GPTQ / AWQ /
    compressed-tensors folder's (engine.layers.weights.read_quantized)."""
    return weights.read_quantized(model_path, config, checkpoint_names(config), shard)
