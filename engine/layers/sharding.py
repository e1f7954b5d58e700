"""Which slice of each checkpoint tensor a tensor-parallel rank holds, by HF name.

Megatron's layout, in the building blocks every family shares:
- column-parallel (rows of [out, in] split): q/k/v (by heads), gate/up (by intermediate);
  a checkpoint that fuses them (Phi-3's qkv_proj and gate_up_proj) gives each rank its
  slice of each part, side by side in the same order;
- row-parallel (columns split): o_proj (by heads) and down_proj (by intermediate), whose
  partial outputs one all-reduce per block sums; a bias after a row-parallel matmul
  (gpt-oss's o_proj and expert down biases) is held by rank 0 only (zeros elsewhere), so
  the sum adds it once;
- vocab-parallel: the embedding and the LM head, rows split by token id;
- MoE experts: tensor parallel inside each expert (each expert's gate/up/down split like a
  dense MLP, gpt-oss's stacked experts and their biases too); the router is replicated, so
  every rank routes the same way;
- attention sinks (gpt-oss: one logit per query head) split with the query heads.
KV heads split across ranks; with fewer KV heads than ranks each KV head is held by the
ranks whose query heads use it (replicated). Norms, routers and gates are replicated.

A dimension split into n parts that does not divide evenly (vocabulary, intermediate) is
padded with zero rows/columns to ceil(size / n) per rank: a zero row of gate/up gives a
zero activation (SwiGLU, GeGLU and gpt-oss's clamped SwiGLU all give 0 for a zero gate)
and a zero column of down adds nothing, so the result is exact.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from engine.layers.config import ModelConfig
from engine.layers.gguf_weights import MXFP4_BLOCK
from shared.startup_checks import StartupError

# Families whose blocks are sharded (Idefics3's text model is "llama", marked multimodal).
TP_FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gemma2",
               "gemma3", "phi3", "gpt_oss")

# Last parts of HF names: column-parallel by intermediate, row-parallel by intermediate.
_GATE_UP = (".gate_proj.weight", ".up_proj.weight", ".w1.weight", ".w3.weight")
_DOWN = (".down_proj.weight", ".w2.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# gpt-oss's stacked experts: (dimension, how) by the name's last part; gate and up are
# interleaved column by column ("pairs": a rank's slice keeps each gate beside its up).
_STACKED_EXPERTS = {
    ".experts.gate_up_proj": (2, "pairs"),  # [E, hidden, 2 * inter]
    ".experts.gate_up_proj_bias": (1, "pairs"),  # [E, 2 * inter]
    ".experts.down_proj": (1, "even"),  # [E, inter, hidden]
    ".experts.down_proj_bias": (1, "first"),  # [E, hidden]: added after the sum
    # MXFP4: [E, out, in / 32, 16] blocks and [E, out, in / 32] scales
    ".experts.gate_up_proj_blocks": (1, "pairs"),
    ".experts.gate_up_proj_scales": (1, "pairs"),
    ".experts.down_proj_blocks": (2, "even"),
    ".experts.down_proj_scales": (2, "even"),
}

def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse, naming it, a model that `size` ranks cannot split."""
    if size == 1:
        return
    if config.architecture not in TP_FAMILIES or config.multimodal not in (None, "idefics3"):
        name = config.multimodal or config.architecture
        raise StartupError(
            f"--tensor-parallel-size {size}: the {name} family is not sharded "
            f"yet (tensor parallelism serves {', '.join(TP_FAMILIES)}, idefics3)")
    if config.num_heads % size:
        raise StartupError(
            f"--tensor-parallel-size {size}: the model's {config.num_heads} attention heads "
            f"do not divide into {size} ranks")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise StartupError(
            f"--tensor-parallel-size {size}: the model's {kv} KV heads neither divide into "
            f"{size} ranks nor does {size} divide by them (needed to replicate them)")
    options = config.family_options
    if getattr(options, "mxfp4", False):
        blocks = config.moe.intermediate_size // MXFP4_BLOCK
        if blocks % size:  # a rank's part of down_proj must be whole MXFP4 blocks
            raise StartupError(
                f"--tensor-parallel-size {size}: the experts' intermediate size "
                f"{config.moe.intermediate_size} is {blocks} MXFP4 blocks of {MXFP4_BLOCK}, "
                f"which do not divide into {size} ranks")


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
        """(dimension, how it is split) for a sharded tensor, None for a replicated one."""
        if name in _VOCAB:
            return 0, "even"
        if ".self_attn." in name:
            if ".qkv_proj." in name:  # Phi-3: q, k and v rows in one tensor
                return 0, "qkv"
            if ".q_proj." in name or name.endswith(".sinks"):
                return 0, "q"
            if ".k_proj." in name or ".v_proj." in name:
                return 0, "kv"
            if name.endswith(".o_proj.weight"):
                return 1, "q"
            if name.endswith(".o_proj.bias"):
                return 0, "first"
            return None  # q/k norms: per head_dim
        if name.endswith(".gate_up_proj.weight"):  # Phi-3: gate rows, then up rows
            return 0, "halves"
        if name.endswith(_GATE_UP):
            return 0, "even"
        if name.endswith(_DOWN):
            return 1, "even"
        for suffix, split in _STACKED_EXPERTS.items():
            if name.endswith(suffix):
                return split
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

    def _pieces(self, how: str, length: int) -> list[tuple[int, int, int]]:
        """This rank's pieces of a dimension, in order: (start, stop, padded length) each.
        One piece, except for a fused tensor: a piece of each of its parts."""
        if how == "qkv":
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return [self._range("q", q), _shift(self._range("kv", kv), q),
                    _shift(self._range("kv", kv), q + kv)]
        if how == "halves":
            half = self._range("even", length // 2)
            return [half, _shift(half, length // 2)]
        if how == "pairs":  # gate/up interleaved: split by (gate, up) column pairs
            start, stop, per = self._range("even", length // 2)
            return [(2 * start, 2 * stop, 2 * per)]
        if how == "first":  # rank 0 holds it whole, the others zeros of its shape
            return [(0, length if self.rank == 0 else 0, length)]
        return [self._range(how, length)]

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        split = self._split(name)
        if split is None or self.size == 1:
            return shape
        dim, how = split
        per = sum(p for _, _, p in self._pieces(how, shape[dim]))
        return (*shape[:dim], per, *shape[dim + 1:])

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor, in memory of its own (a copy, so
        the full tensor is freed once the loader lets go of it). Replicated tensors are
        copied too: a safetensors tensor is a view of the memory-mapped file, and one view
        kept would keep the whole file mapped (and resident) in every rank."""
        if self.size == 1:
            return tensor
        if self._split(name) is None:
            return tensor.clone()
        return self.take_from(name, tuple(tensor.shape),
                              lambda dim, start, stop: tensor.narrow(dim, start, stop - start))

    def take_from(self, name: str, shape: tuple[int, ...], read) -> torch.Tensor:
        """`take` of a tensor of `shape` that is read piece by piece: read(dim, start, stop)
        gives its [start, stop) along dim (a GGUF's blocks dequantized only where the rank's
        part lies, engine.layers.weights)."""
        split = self._split(name)
        if split is None:
            return read(0, 0, shape[0]).clone()
        dim, how = split
        parts = []
        for start, stop, per in self._pieces(how, shape[dim]):
            part = read(dim, start, stop)
            if stop - start < per:  # the padding of an uneven split (or "first": all of it)
                padding = list(part.shape)
                padding[dim] = per - (stop - start)
                part = torch.cat([part, part.new_zeros(padding)], dim=dim)
            parts.append(part)
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=dim)

    def take_blocks(self, name: str, blocks: np.ndarray, block_weights: int,
                    block_bytes: int) -> np.ndarray | None:
        """This rank's part of a GGUF block-quantized matrix (uint8 [out, in / block_weights
        * block_bytes], rows in HF order), cut as `take` cuts the dense one, in memory of its
        own. Rows (column-parallel, vocab-parallel) cut anywhere; the input dimension
        (row-parallel o_proj, down_proj) only on block boundaries: None where a cut falls
        inside a block (the rank then multiplies its dense slice). Padding is zero bytes,
        which every kind reads as zero weights (its scales are 0)."""
        split = self._split(name)
        if split is None or self.size == 1:
            return np.array(blocks)
        dim, how = split
        if dim == 0:
            length, unit, scale = blocks.shape[0], 1, 1
        else:  # in weights, cut in whole blocks of block_bytes
            length = blocks.shape[1] // block_bytes * block_weights
            unit, scale = block_weights, block_bytes
        parts = []
        for start, stop, per in self._pieces(how, length):
            if start % unit or stop % unit or per % unit:
                return None
            start, stop, per = (v // unit * scale for v in (start, stop, per))
            part = blocks[start:stop] if dim == 0 else blocks[:, start:stop]
            if stop - start < per:
                shape = list(blocks.shape)
                shape[dim] = per - (stop - start)
                part = np.concatenate([part, np.zeros(shape, blocks.dtype)], axis=dim)
            parts.append(part)
        return np.ascontiguousarray(np.concatenate(parts, axis=dim))

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """(first token id, rows) of this rank's vocabulary part (rows: padded length)."""
        start, _, per = self._range("even", vocab_size)
        return start, per


def _shift(piece: tuple[int, int, int], offset: int) -> tuple[int, int, int]:
    start, stop, per = piece
    return start + offset, stop + offset, per
