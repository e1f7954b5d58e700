"""`CpuKernelOps`: `TorchOps` with the engine's compiled CPU kernels (norms, RoPE,
SiLU-and-mul, and linears over a checkpoint's quantized blocks), and the row counts that pick
between the kernels and oneDNN (docs/benchmarks.md)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.layers.gguf_weights import BLOCK_KINDS
from engine.layers.torch_ops import TorchOps, rms_norm

# The block kind whose packed layout takes every kind's weights exactly (Q6_K's: two
# float32 scales and a min per 32 int8), for a fused weight whose parts differ in kind.
ANY_KIND_LAYOUT = BLOCK_KINDS["Q6_K"]

# Rows up to which a block-quantized weight is multiplied in place. Past it, the blocks'
# unpacking stops paying against oneDNN's bf16 matmul (AMX) over the dense copy
# (benchmarks in docs/benchmarks.md).
QUANTIZED_MAX_ROWS = 4
# The same for float32 rows, where oneDNN's alternative reads float32 weights: the blocks
# stay ahead up to 16 rows (AVX2 and AVX-512 builds alike, docs/benchmarks.md).
QUANTIZED_MAX_ROWS_FLOAT32 = 16
# Rows of a weight held only as blocks (a GGUF's MoE expert, loaded without a dense copy)
# up to which the block kernel multiplies them; past it the expert is dequantized into a
# scratch tensor for that call and F.linear runs over it (docs/benchmarks.md, "GGUF MoE
# experts as blocks"). The batch-invariant mode always takes the kernel.
BLOCKS_ONLY_MAX_ROWS = 16
BLOCKS_ONLY_MAX_ROWS_BF16 = 128
# Rows up to which a widened (bfloat16-held) weight is multiplied by the kernel, which reads
# the bfloat16 weights; past it (prefill chunks, big batches) F.linear over a float32 copy
# made per call costs less than the kernel's float32 tiles.
WIDENED_MAX_ROWS = 16


_NO_TENSOR = torch.empty(0)  # decode_layer's "no next norm": the last layer

# Kinds whose linear rounds float32 rows to int16 per group of 4 values and multiplies in
# integers (cpu_kernels.cpp's "int16 activations", llama.cpp's lever with these blocks at
# twice its bits): fewer instructions per weight than widening each to float32
# (docs/benchmarks.md, "int16 activations"): the Q4_1 linears and the Q8_0 LM head of the
# default model. bfloat16 rows keep the bf16 dot products.
INT16_X_KINDS = frozenset({BLOCK_KINDS["Q4_1"], BLOCK_KINDS["Q8_0"]})
# Rows up to which they do (SLUICE_CPU_INT16_ROWS=N overrides; 0 turns it off): past 2 rows
# the float path's register tile shares each unpacked weight block between 4 rows and the
# integer path stops paying (docs/benchmarks.md). Each value moves by at most 2^-16 of its
# group's largest, where an int8 rounding (the path this one replaced) moved greedy tokens
# off transformers' (tests/integration/test_reference.py) and speculative decoding's
# logprobs 0.04 off (tests/integration/test_spec_decode.py holds them to 1e-3); both files
# stay green with this default.
INT16_X_MAX_ROWS = 2


def int16_x_max_rows_env() -> int:
    """SLUICE_CPU_INT16_ROWS, else INT16_X_MAX_ROWS."""
    value = os.environ.get("SLUICE_CPU_INT16_ROWS", "").strip()
    if not value:
        return INT16_X_MAX_ROWS
    if not value.isdigit():
        raise ValueError(f"SLUICE_CPU_INT16_ROWS={value!r}: expected a row count (0: off)")
    return int(value)


class CpuKernelOps(TorchOps):
    """TorchOps with the engine's compiled CPU kernels (`engine.kernels.cpu_kernels`): RMSNorm
    (alone and fused with the residual add), RoPE and SiLU-and-mul in one call each instead
    of two to eight torch ops, with the same roundings (tests/unit/test_cpu_kernels.py), and
    small-batch linears over the checkpoint's quantized blocks. Falls back to TorchOps for
    tensors the kernels do not take (another device, float16).

    batch_invariant (--batch-invariant): every linear, whatever its row count, runs the
    engine's own kernel (over the quantized blocks where the checkpoint has them, else over
    the dense weight), which sums each output alone in one fixed order, so a row's result
    never depends on what else is in the step. oneDNN, which picks its blocking by the row
    count, is never called. The norms, RoPE and SiLU-and-mul kernels are per row already."""

    def __init__(self, kernels, batch_invariant: bool = False,
                 int16_x_max_rows: int | None = None) -> None:
        super().__init__()
        self._k = kernels
        # Float32 rows over INT16_X_KINDS blocks take the int16 path up to this many rows,
        # where the build has it; never in the batch-invariant mode, where a row's numbers
        # may not depend on how many rows came with it.
        rows = int16_x_max_rows_env() if int16_x_max_rows is None else int16_x_max_rows
        has = getattr(kernels, "int16_dot", False) and not batch_invariant
        self.int16_x_max_rows = rows if has else 0
        self._quantized: dict[int, object] = {}  # id(weight) -> QuantizedWeight
        self._widened: set[int] = set()  # ids of bfloat16 weights of a float32 model
        self.batch_invariant = batch_invariant
        self.name = "torch+cpu-kernels" + (" (batch-invariant)" if batch_invariant else "")

    def stored_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A float32 weight whose every value is a bfloat16 (a bf16 checkpoint's, loaded as
        float32) is held in bfloat16 where the CPU has no bf16 dot product (where it has
        one, `--dtype auto` runs the model in bfloat16 already): the kernel widens it block
        by block, exactly, so the products are the float32 model's and a decode step reads
        half the bytes. Any other weight is kept as it is."""
        if (weight.dtype != torch.float32 or weight.device.type != "cpu"
                or self._k.bf16_quantized or weight.dim() != 2 or weight.shape[1] % 32):
            return weight
        narrow = weight.to(torch.bfloat16)
        if not torch.equal(narrow.to(torch.float32), weight):
            return weight  # not bf16-exact (a GGUF checkpoint's float32 values): keep it
        self._widened.add(id(narrow))
        return narrow

    def prepack(self, weight: torch.Tensor) -> None:
        if id(weight) in self._widened:
            return  # the kernel reads it as it is
        if not self.batch_invariant:
            return super().prepack(weight)
        # No oneDNN copy to make; instead refuse, at load, a weight the kernel cannot take.
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.shape[1] % 32:
            raise ValueError(
                f"--batch-invariant runs float32 or bfloat16 linears whose input width is a "
                f"multiple of 32; this model has a {str(weight.dtype).removeprefix('torch.')} "
                f"weight of shape {tuple(weight.shape)}")

    def attach_quantized(self, weight: torch.Tensor, parts: list) -> None:
        """Multiply small batches by the checkpoint's blocks (5 to 11 bits a weight once
        repacked, not 16 or 32): a decode step is bound by reading the weights. Parts of
        different kinds (a Q4_K_M file's Q6_K attn_v beside its Q4_K q and k) are packed
        into the one layout every kind fits, Q6_K's (11 bits a weight). In bfloat16 the
        kernel rounds each weight to exactly the bfloat16 value `weight` holds, so results
        differ from the dense path only in summation order; float32 weights are exact
        either way."""
        if weight.device.type not in ("cpu", "meta"):  # meta: an expert held as blocks only
            return
        widened = id(weight) in self._widened  # a float32 model: the float32 kernel
        if weight.dtype == torch.bfloat16 and not self._k.bf16_quantized and not widened:
            return  # no AVX512-BF16: stay on the dense oneDNN path
        if weight.dtype in (torch.float32, torch.bfloat16):
            if any(q.packed for q in parts):
                self._quantized[id(weight)] = _joined_packed(parts)
                return
            kinds = {q.kind for q in parts}
            kind = kinds.pop() if len(kinds) == 1 else ANY_KIND_LAYOUT
            packed = torch.cat([self._k.pack_blocks(q.blocks, q.kind, kind) for q in parts])
            self._quantized[id(weight)] = type(parts[0])(kind, packed)

    def multiplies_blocks(self, dtype: torch.dtype) -> bool:
        # attach_quantized's condition for a weight that is not widened.
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self._k.bf16_quantized)

    def holds_blocks(self, weight: torch.Tensor) -> bool:
        return id(weight) in self._quantized

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        quantized = self._quantized.get(id(weight))
        if weight.is_meta:  # held as blocks only (LlamaModel checked that there are blocks)
            return self._blocks_only_linear(x, quantized, bias)
        if id(weight) in self._widened and quantized is None:
            return self._widened_linear(x, weight, bias)
        if self.batch_invariant:
            x = x.reshape(-1, x.shape[-1]).contiguous()
            out = (self._k.dense_linear(x, weight) if quantized is None else
                   self._blocks_linear(x, quantized))
        elif quantized is None or x.dim() != 2 or x.shape[0] > self._quantized_max_rows(x):
            return super().linear(x, weight, bias)
        else:
            out = self._blocks_linear(x.contiguous(), quantized)
        return out if bias is None else out + bias

    def int16_x(self, x: torch.Tensor, kind: int) -> bool:
        """Whether rows like x times blocks of `kind` take the kernel's int16 path."""
        return (x.dtype == torch.float32 and kind in INT16_X_KINDS
                and x.shape[0] <= self.int16_x_max_rows)

    def _blocks_linear(self, x: torch.Tensor, quantized) -> torch.Tensor:
        if quantized.perm is not None:  # the blocks' column order (GPTQ desc_act)
            x = x.index_select(-1, quantized.perm)
        return self._k.quantized_linear(x, quantized.blocks, quantized.kind,
                                        int16_x=self.int16_x(x, quantized.kind))

    @staticmethod
    def _quantized_max_rows(x: torch.Tensor) -> int:
        return QUANTIZED_MAX_ROWS_FLOAT32 if x.dtype == torch.float32 else QUANTIZED_MAX_ROWS

    def _blocks_only_linear(self, x: torch.Tensor, quantized,
                            bias: torch.Tensor | None) -> torch.Tensor:
        """x @ a weight that exists only as blocks: the kernel up to BLOCKS_ONLY_MAX_ROWS
        rows (every row count in the batch-invariant mode, as for the dense linears' blocks);
        past it F.linear over the weights dequantized for this call alone (the very values
        the kernel reads, rounded to x's dtype as a dense load rounds them), so the engine
        holds one expert's dense copy at a time, never all of them."""
        rows = x.reshape(-1, x.shape[-1])
        if quantized.perm is not None:  # the blocks' column order (GPTQ desc_act)
            rows = rows.index_select(-1, quantized.perm)
        limit = (BLOCKS_ONLY_MAX_ROWS if x.dtype == torch.float32
                 else BLOCKS_ONLY_MAX_ROWS_BF16)
        if self.batch_invariant or rows.shape[0] <= limit:
            # Float x (no int16 path): below the limit and past it alike, an expert's rows
            # are multiplied by the very weights the dense model holds.
            out = self._k.quantized_linear(rows.contiguous(), quantized.blocks, quantized.kind)
            out = out if bias is None else out + bias
        else:
            dense = self._k.dequantize_blocks(quantized.blocks, quantized.kind)
            out = F.linear(rows, dense.to(x.dtype), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    # ------------------------------------------------- a whole decoder layer in one call

    def layer_blocks(self, weights: list[torch.Tensor]) -> tuple[list, list] | None:
        """The packed blocks and kinds of a layer's q/k/v, o, gate/up and down weights for
        `decode_layer`, or None where any of them has none (a dense or widened weight)."""
        found = [self._quantized.get(id(w)) for w in weights]
        if any(q is None or q.perm is not None for q in found) or not hasattr(
                self._k, "decode_layer"):
            return None  # (the fused kernel never reorders a linear's inputs)
        return [q.blocks for q in found], [q.kind for q in found]

    def takes_decode_layer(self, x: torch.Tensor) -> bool:
        """Whether `linear` would send these rows to the blocks (so `decode_layer`, which
        always does, computes what the per-op path would)."""
        return self._fits(x) and (self.batch_invariant
                                  or x.shape[0] <= self._quantized_max_rows(x))

    def decode_layer(self, x: torch.Tensor, h: torch.Tensor, blocks: tuple[list, list],
                     post_norm: torch.Tensor, next_norm: torch.Tensor | None, eps: float,
                     rope, positions: torch.Tensor, heads: int, kv_heads: int,
                     attention: tuple) -> tuple[torch.Tensor, ...]:
        """One decoder layer of a pure decode step in one kernel call (the same kernels in
        the same order as the per-op path, so the same bits; cpu_kernels.cpp's
        decode_layer). attention: the backend's `decode_kernel_inputs` for this layer."""
        # A narrow cache (--kv-cache-dtype) adds its K and V scales.
        k_cache, v_cache, slots, table, lengths, page_size, *scales = attention
        k_scale, v_scale = scales or (1.0, 1.0)
        return self._k.decode_layer(
            x, h, blocks[0], blocks[1], post_norm,
            next_norm if next_norm is not None else _NO_TENSOR, eps, rope.cos, rope.sin,
            positions, heads, kv_heads, k_cache, v_cache, slots, table, lengths, page_size,
            k_cache.shape[-1] ** -0.5 * k_scale, [self.int16_x(x, kind) for kind in blocks[1]],
            k_scale, v_scale)

    def _widened_linear(self, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        """x (float32) @ a bfloat16-held weight: the kernel, which widens the weight as it
        reads it, up to WIDENED_MAX_ROWS rows (every row count in the batch-invariant mode);
        F.linear over a float32 copy past it."""
        rows = x.reshape(-1, x.shape[-1])
        if self.batch_invariant or rows.shape[0] <= WIDENED_MAX_ROWS:
            out = self._k.dense_linear(rows.contiguous(), weight)
            out = out.reshape(*x.shape[:-1], weight.shape[0])
            return out if bias is None else out + bias
        return F.linear(x, weight.to(x.dtype), bias)

    @staticmethod
    def _fits(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._fits(x) or x.stride(-1) != 1 or x.dim() not in (2, 3):
            return rms_norm(x, weight, eps)
        return self._k.rms_norm(x, weight.contiguous(), eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fits(h) or h.dim() != 2 or delta.dtype != h.dtype:
            return super().add_rms_norm(h, delta, weight, eps)
        normed, summed = self._k.add_rms_norm(h.contiguous(), delta.contiguous(),
                                              weight.contiguous(), eps)
        return normed, summed

    def rope_tables(self, rope, positions: torch.Tensor):
        return None  # the kernel reads the full tables at each token's position itself

    def rope(self, rope, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             tables=None):
        # The kernel rotates whole heads; a partial rotary takes the torch path.
        if not self._fits(q) or rope.cos.dtype != q.dtype or rope.cos.shape[-1] != q.shape[-1]:
            return super().rope(rope, q, k, positions, tables)
        both = self._k.rope(q, k, rope.cos, rope.sin, positions.contiguous())
        return both[:, : q.shape[1]], both[:, q.shape[1] :]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fits(x) or x.dim() != 2:
            return super().silu_and_mul(x)
        return self._k.silu_and_mul(x.contiguous())


def _joined_packed(parts: list):
    """The parts of a fused weight already in the kernels' layout (engine.layers.quant_formats),
    stacked: one kind and one input order for all, which the loader gives every part of a
    checkpoint (a g_idx order differing between parts is refused)."""
    kinds = {q.kind for q in parts}
    if len(kinds) != 1 or not all(q.packed for q in parts):
        raise ValueError("a fused weight's quantized parts are in different block layouts")
    perms = [q.perm for q in parts]
    if any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0]))
           for p in perms):
        raise ValueError("the q/k/v (or gate/up) projections of a desc_act checkpoint order "
                         "their inputs differently (g_idx); they share one input and must not")
    return type(parts[0])(kinds.pop(), torch.cat([q.blocks for q in parts]), packed=True,
                          perm=perms[0])
