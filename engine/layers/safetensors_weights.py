"""HF safetensors folders into the model's tensor names, MoE experts optionally left in the
file, memory-mapped (`in_mapped_file`)."""

from __future__ import annotations

import glob
import os
import weakref

import msgspec
import torch
from safetensors import safe_open

from engine.layers.config import ModelConfig


def text_name_of(config: ModelConfig):
    """Checkpoint name -> the text model's HF name, or None for a tensor it does not use.
    Idefics3 nests the text model under model.text_model; its vision encoder and connector
    load separately (engine.models.idefics3)."""
    if config.multimodal != "idefics3":
        return lambda name: name
    vision = ("model.vision_model.", "model.connector.")

    def rename(name: str) -> str | None:
        if name.startswith(vision):
            return None
        return name.replace("model.text_model.", "model.", 1)

    return rename


def load_safetensors(folder, expected, dtype, rename=lambda n: n,
                      take=lambda name, t: t, map_experts_as=None) -> dict[str, torch.Tensor]:
    weights = {}
    for shard in safetensors_shards(folder):
        mapped = _MappedFile(shard) if map_experts_as is not None else None
        with safe_open(shard, framework="pt") as f:
            for stored in f.keys():
                name = rename(stored)
                if name is None:
                    continue
                if name in expected:
                    tensor = None
                    if mapped is not None and ".experts." in name:
                        tensor = mapped.tensor(stored, map_experts_as)
                        if tensor is None:  # MXFP4 codes: mapped too, repacked from the file
                            tensor = mapped.tensor(stored, torch.uint8)
                    if tensor is None:
                        tensor = take(name, _as_dtype(f.get_tensor(stored), dtype))
                    weights[name] = tensor
                elif not _ignorable(name):
                    raise ValueError(f"unexpected tensor {name!r} in {shard}")
    return weights


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float tensor as `dtype`; uint8 codes (gpt-oss's MXFP4 blocks and scales) stay
    bytes: as floats they would take 2 to 4 times the checkpoint's memory."""
    return tensor if tensor.dtype == torch.uint8 else tensor.to(dtype)


# safetensors' dtype names -> torch's, for the tensors worth mapping.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                       "U8": torch.uint8}


class _TensorEntry(msgspec.Struct):
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]  # from the end of the header


class _MappedFile:
    """A .safetensors file mapped copy-on-write (never written: its pages stay the page
    cache's), handing out tensors that are views of it. The format: an 8-byte little-endian
    header length, a JSON header of name -> dtype, shape, byte offsets, then the data."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = msgspec.json.decode(f.read(length))
        header.pop("__metadata__", None)
        self.entries = msgspec.convert(header, dict[str, _TensorEntry])
        self.data_start = 8 + length
        self.path = path
        self._bytes: torch.Tensor | None = None  # the whole file, mapped on first use

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The stored tensor as a view of the file, or None where it is not stored as
        `dtype` (or not aligned for it): the caller copies it then."""
        entry = self.entries.get(name)
        if entry is None or _SAFETENSORS_DTYPES.get(entry.dtype) != dtype:
            return None
        begin, end = (self.data_start + offset for offset in entry.data_offsets)
        if begin % dtype.itemsize or end - begin != _numel(entry.shape) * dtype.itemsize:
            return None
        if self._bytes is None:
            self._bytes = torch.from_file(self.path, shared=False,
                                          size=os.path.getsize(self.path), dtype=torch.uint8)
            storage = self._bytes.untyped_storage()
            _MAPPED_STORAGES.add(storage.data_ptr())
            # Unmapped once no view of it is left; its address may then be reused.
            weakref.finalize(storage, _MAPPED_STORAGES.discard, storage.data_ptr())
        return self._bytes[begin:end].view(dtype).view(entry.shape)


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


# The addresses of the checkpoint files mapped now (the storages _MappedFile views).
_MAPPED_STORAGES: set[int] = set()


def in_mapped_file(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is one of the memory-mapped expert tensors `read_weights` hands out
    (a view of its checkpoint file). Copying it (a concatenation, a reordered layout) would
    take its bytes again, in private memory."""
    return (tensor.device.type == "cpu"
            and tensor.untyped_storage().data_ptr() in _MAPPED_STORAGES)


def _ignorable(name: str) -> bool:
    # Old checkpoints carry RoPE buffers, and some tied ones still store a copy of lm_head.
    # KV cache scales are read apart, by --kv-cache-dtype (engine.attention.kv_dtype).
    return (name.endswith(("rotary_emb.inv_freq", ".self_attn.k_scale", ".self_attn.v_scale",
                           ".self_attn.kv_scale")) or name == "lm_head.weight")


class _ShardIndex(msgspec.Struct):
    weight_map: dict[str, str]  # tensor name -> shard file name


def safetensors_shards(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, "rb") as f:
            weight_map = msgspec.json.decode(f.read(), type=_ShardIndex).weight_map
        shard_names = sorted(set(weight_map.values()))
        return [os.path.join(folder, name) for name in shard_names]
    # Only HF-layout files: mistral repos also ship consolidated.safetensors, with other names.
    shards = sorted(glob.glob(os.path.join(folder, "model*.safetensors")))
    if not shards:
        raise ValueError(f"no model*.safetensors files in {folder!r}")
    return shards
