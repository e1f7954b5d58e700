"""Weight loading into Hugging Face tensor names, from GGUF files (`gguf_weights.py`) or
safetensors folders (`safetensors_weights.py`): `read_weights` picks the loader and checks
what it read against the family's shapes.

The model code consumes one naming scheme (HF's, Linear weights as [out, in]) whatever the
checkpoint format; the family's tensor shapes are the contract both loaders are checked
against. What a loader needs of the family comes in as data (`CheckpointNames`, built by
engine.models.registry), so this module never looks a family up: the registry imports the
families, which import this module.
"""

import torch

from engine.layers.checkpoint_names import CheckpointNames
from engine.layers.config import ModelConfig
from engine.layers.gguf_weights import QuantizedWeight, load_gguf, read_quantized_weights
from engine.layers.quant_config import checkpoint_quantization
from engine.layers.quant_weights import (
    quantized_placeholders,
    read_checkpoint_blocks,
    skipping_quantized,
)
from engine.layers.safetensors_weights import load_safetensors, text_name_of


def read_weights(
    model_path: str, config: ModelConfig, names: CheckpointNames, dtype: torch.dtype,
    pooling: bool = False,
    shard=None, map_experts_as: torch.dtype | None = None,
    experts_as_blocks: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Load all weights of a `.gguf` file or HF safetensors folder as `dtype` tensors.

    `pooling`: for a pooling runner, which never computes logits: the LM head may be absent
    (it then shares the embedding's storage, unused), and a checkpoint saved from the bare
    model (Qwen3-Embedding: `layers.0...`, no `model.` prefix) loads too.
    shard: a tensor-parallel rank's `engine.layers.sharding.Shard`; each tensor is then cut
    to that rank's part as it is read, so no process holds the whole model.
    map_experts_as: the dtype the model computes in. A safetensors checkpoint's MoE expert
    tensors stored in it are left in the file, memory-mapped (see `in_mapped_file`), not
    copied as `dtype`: experts are most of an MoE model's bytes, and the page cache holds
    them once however many times they are mapped. Not with a shard. (uint8 tensors, gpt-oss's
    MXFP4 blocks and scales, load as bytes, never as `dtype`; expert ones mapped too.)
    experts_as_blocks: the dtype the model computes in, where its ops multiply a GGUF's
    block-quantized experts themselves (CpuKernelOps.multiplies_blocks). A layer whose
    stacked experts (ffn_*_exps) are all stored in a BLOCK_KINDS kind is then not
    dequantized: each expert's weight is a meta tensor of that dtype and its shape, holding
    no bytes, which the model hands to the ops with the expert's blocks
    (read_quantized_weights). Not with a shard. A GPTQ / AWQ / compressed-tensors folder's
    quantized linears stand as such meta tensors too (of this dtype; the folder is refused
    without it): the ops multiply their blocks (read_quantized)."""
    expected = names.shapes

    def take(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if shard is None:
            return tensor
        if tuple(tensor.shape) != expected[name]:  # checked whole, before it is cut
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
        return shard.take(name, tensor)

    if model_path.endswith(".gguf"):
        blocks_as = experts_as_blocks if shard is None else None
        weights = load_gguf(model_path, config, names, dtype, take, shard, blocks_as)
    else:
        rename = names.rename or text_name_of(config)
        if pooling:
            rename = _bare_model_names(rename, expected)
        mapped = map_experts_as if shard is None else None
        scheme = checkpoint_quantization(model_path)
        dense = rename if scheme is None else skipping_quantized(rename, scheme)
        weights = load_safetensors(model_path, expected, dtype, dense, take, mapped)
        if scheme is not None:
            if experts_as_blocks is None or shard is not None:
                raise ValueError(f"a {scheme.method} checkpoint's linears run on the CPU "
                                 "kernels' blocks only, which these ops do not multiply")
            weights.update(quantized_placeholders(model_path, scheme, rename, expected,
                                                  experts_as_blocks))
    embed = weights.get("model.embed_tokens.weight")
    if pooling and embed is not None and "lm_head.weight" in expected.keys() - weights.keys():
        weights["lm_head.weight"] = embed  # shapes agree: [vocab, hidden]
    if shard is not None:
        expected = {name: shard.local_shape(name, shape) for name, shape in expected.items()}
    _check_complete(weights, expected)
    return weights


def read_quantized(model_path: str, config: ModelConfig, names: CheckpointNames,
                   shard=None) -> dict[str, QuantizedWeight]:
    """The linears the CPU kernels multiply as blocks, by HF name: a GGUF file's
    (read_quantized_weights), or a GPTQ / AWQ / compressed-tensors folder's, repacked into
    the kernels' layout (engine.layers.quant_weights); empty for anything else."""
    if model_path.endswith(".gguf"):
        return read_quantized_weights(model_path, config, names, shard)
    scheme = checkpoint_quantization(model_path)
    if scheme is None:
        return {}
    rename = names.rename or text_name_of(config)
    return read_checkpoint_blocks(model_path, scheme, rename, names.shapes)


def _bare_model_names(rename, expected):
    def bare(name: str) -> str | None:
        name = rename(name)
        if name is not None and name not in expected and f"model.{name}" in expected:
            return f"model.{name}"
        return name

    return bare


def _check_complete(weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]):
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
