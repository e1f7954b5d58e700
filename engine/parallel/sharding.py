"""Which slice of each checkpoint tensor a tensor-parallel rank holds, by HF name.

Megatron's layout, in the building blocks every Llama-derived family shares:
- column-parallel (rows of [out, in] split): q/k/v (by heads), gate/up (by intermediate);
- row-parallel (columns split): o_proj (by heads) and down_proj (by intermediate), whose
  partial outputs one all-reduce per block sums;
- vocab-parallel: the embedding and the LM head, rows split by token id;
- MoE experts: tensor parallel inside each expert (each expert's gate/up/down split like a
  dense MLP); the router is replicated, so every rank routes the same way.
KV heads split across ranks; with fewer KV heads than ranks each KV head is held by the
ranks whose query heads use it (replicated). Norms, routers and gates are replicated.

A dimension split into n parts that does not divide evenly (vocabulary, intermediate) is
padded with zero rows/columns to ceil(size / n) per rank: a zero row of gate/up gives a
zero activation and a zero column of down adds nothing, so the result is exact.
"""

from __future__ import annotations

import msgspec
import torch

from engine.models.config import ModelConfig
from shared.startup_checks import StartupError

# Families whose model is LlamaModel's blocks with HF per-projection tensors. The others
# (fused checkpoint tensors, attention sinks, biases on o_proj, vision encoders) are
# refused under tensor parallelism until their blocks are sharded too.
TP_FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")

# Last parts of HF names: column-parallel by intermediate, row-parallel by intermediate.
_GATE_UP = (".gate_proj.weight", ".up_proj.weight", ".w1.weight", ".w3.weight")
_DOWN = (".down_proj.weight", ".w2.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse, naming it, a model that `size` ranks cannot split."""
    if size == 1:
        return
    if config.architecture not in TP_FAMILIES or config.multimodal:
        raise StartupError(
            f"--tensor-parallel-size {size}: the {config.architecture} family is not sharded "
            f"yet (tensor parallelism serves {', '.join(TP_FAMILIES)})")
    if config.num_heads % size:
        raise StartupError(
            f"--tensor-parallel-size {size}: the model's {config.num_heads} attention heads "
            f"do not divide into {size} ranks")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise StartupError(
            f"--tensor-parallel-size {size}: the model's {kv} KV heads neither divide into "
            f"{size} ranks nor does {size} divide by them (needed to replicate them)")


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's model and KV cache see: its own heads (the rest is whole)."""
    if size == 1:
        return config
    return msgspec.structs.replace(config, num_heads=config.num_heads // size,
                                   num_kv_heads=max(1, config.num_kv_heads // size))


class Shard(msgspec.Struct, frozen=True):
    """Rank `rank` of `size` over a model with these head counts."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int) -> Shard:
        return cls(rank, size, config.num_heads, config.num_kv_heads, config.head_dim)

    def _split(self, name: str) -> tuple[int, str] | None:
        """(dimension, what is split) for a sharded tensor, None for a replicated one."""
        if name in _VOCAB:
            return 0, "even"
        if ".self_attn." in name:
            if ".q_proj." in name:
                return 0, "q"
            if ".k_proj." in name or ".v_proj." in name:
                return 0, "kv"
            if name.endswith(".o_proj.weight"):
                return 1, "q"
            return None  # q/k norms: per head_dim
        if name.endswith(_GATE_UP):
            return 0, "even"
        if name.endswith(_DOWN):
            return 1, "even"
        return None

    def _range(self, how: str, length: int) -> tuple[int, int, int]:
        """(start, stop, padded length) of this rank's part of a dimension of `length`."""
        if how == "q":
            per = length // self.size
            return self.rank * per, (self.rank + 1) * per, per
        if how == "kv":
            if self.num_kv_heads >= self.size:
                per = length // self.size
                return self.rank * per, (self.rank + 1) * per, per
            # Fewer KV heads than ranks: rank r's query heads all use KV head r // (n / kv).
            head = self.rank // (self.size // self.num_kv_heads)
            per = length // self.num_kv_heads
            return head * per, (head + 1) * per, per
        per = -(-length // self.size)
        start = min(length, self.rank * per)
        return start, min(length, start + per), per

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        split = self._split(name)
        if split is None or self.size == 1:
            return shape
        dim, how = split
        return (*shape[:dim], self._range(how, shape[dim])[2], *shape[dim + 1:])

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor, in memory of its own (a copy, so
        the full tensor is freed once the loader lets go of it). Replicated tensors are
        copied too: a safetensors tensor is a view of the memory-mapped file, and one view
        kept would keep the whole file mapped (and resident) in every rank."""
        split = self._split(name)
        if self.size == 1:
            return tensor
        if split is None:
            return tensor.clone()
        dim, how = split
        start, stop, per = self._range(how, tensor.shape[dim])
        part = tensor.narrow(dim, start, stop - start)
        if stop - start == per:
            return part.clone()
        shape = list(tensor.shape)
        shape[dim] = per
        padded = tensor.new_zeros(shape)
        padded.narrow(dim, 0, stop - start).copy_(part)
        return padded

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """(first token id, rows) of this rank's vocabulary part (rows: padded length)."""
        start, _, per = self._range("even", vocab_size)
        return start, per
