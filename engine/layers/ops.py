"""The model's elementwise building blocks, behind one small interface.

`TorchOps` is the reference: plain torch, every device, the CPU path. Its code is the
model's original code moved here unchanged, so CPU numerics stay exactly what the
transformers reference test pins. `FlashInferOps` swaps in FlashInfer's fused CUDA kernels
(RMSNorm, RoPE from a cos/sin cache, SiLU-and-mul) for fp16/bf16 models on CUDA; it is
only ever built on CUDA, and importing this module never imports flashinfer.

`top_k_top_p_sample` is the sampler's door to FlashInfer's fused top-k/top-p kernel; it
answers None wherever the kernel does not apply, and the sampler then uses its own path.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from engine.layers.weights import BLOCK_KINDS, in_mapped_file


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalised in float32 whatever the dtype, then rounded to the model's dtype and scaled
    # by the weight there, as transformers does. F.rms_norm without a weight does the float32
    # part in one op instead of five, with the same result.
    x32 = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps)
    return weight * x32.to(x.dtype)


# Rows up to which a prepacked weight is used. Decode-sized batches gain most (the per-call
# reorder of the weight is a large share of a small matmul); big prefill chunks keep the
# plain path, where the reorder is amortised.
PACKED_MAX_ROWS = 128
_PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this many rows


def can_prepack(weight: torch.Tensor) -> bool:
    """bf16 weights on a CPU whose oneDNN multiplies bf16 natively."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class TorchOps:
    name = "torch"

    def __init__(self) -> None:
        self._packed: dict[int, torch.Tensor] = {}  # id(weight) -> oneDNN-blocked copy

    def stored_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The tensor to hold for a linear weight (the model then passes it to `linear`):
        `weight` itself here; CpuKernelOps may narrow it."""
        return weight

    def prepack(self, weight: torch.Tensor) -> None:
        """Reorder a linear weight into oneDNN's blocked layout once, where that pays (CPU
        bf16): F.linear would redo the reorder on every call. Elsewhere a no-op."""
        # Not a weight left in its memory-mapped checkpoint (MoE experts): the reordered copy
        # would take its bytes again, in private memory.
        if id(weight) in self._packed or not can_prepack(weight) or in_mapped_file(weight):
            return
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        except RuntimeError:  # an oneDNN build without this reorder: stay on F.linear
            return
        self._packed[id(weight)] = packed

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """F.linear, through the prepacked weight when there is one (same result)."""
        packed = self._packed.get(id(weight))
        if packed is None or x.dim() != 2 or x.shape[0] > PACKED_MAX_ROWS:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def attach_quantized(self, weight: torch.Tensor, parts: list) -> None:
        """Offer the checkpoint's block-quantized rows behind `weight` (a QuantizedWeight
        per fused part, in order); plain torch has no use for them."""

    def multiplies_blocks(self, dtype: torch.dtype) -> bool:
        """Whether every row count of a `dtype` model's linear can run from the blocks
        alone (so the loader may skip the dense copy: load_weights' experts_as_blocks)."""
        return False

    def holds_blocks(self, weight: torch.Tensor) -> bool:
        """Whether attach_quantized took blocks for `weight`."""
        return False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm after it: (rms_norm(h + delta), h + delta)."""
        h = h + delta
        return self.rms_norm(h, weight, eps), h

    def rope_tables(self, rope, positions: torch.Tensor):
        """Per-step rotary inputs, computed once and passed to every layer's `rope`."""
        return rope.tables(positions)

    def rope(self, rope, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             tables=None):
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim] -> both rotated. `tables`
        from rope_tables, or None to look them up here."""
        cos, sin = tables if tables is not None else rope.tables(positions)
        # One rotation over q and k side by side: half the small ops, the same numbers.
        both = rope.rotate(torch.cat((q, k), dim=1), cos, sin)
        return both[:, : q.shape[1]], both[:, q.shape[1] :]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * intermediate] (gate then up) -> silu(gate) * up."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


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
        if any(q is None for q in found) or not hasattr(self._k, "decode_layer"):
            return None
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
        k_cache, v_cache, slots, table, lengths, page_size = attention
        return self._k.decode_layer(
            x, h, blocks[0], blocks[1], post_norm,
            next_norm if next_norm is not None else _NO_TENSOR, eps, rope.cos, rope.sin,
            positions, heads, kv_heads, k_cache, v_cache, slots, table, lengths, page_size,
            k_cache.shape[-1] ** -0.5, [self.int16_x(x, kind) for kind in blocks[1]])

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


# Rows per cuBLAS call in the CUDA batch-invariant mode: a decode batch pays for this many
# rows at least, which on a GPU costs about what one row costs (the weights' read dominates).
CUDA_INVARIANT_ROWS = 64


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tile: int) -> torch.Tensor:
    """F.linear over x in row tiles of exactly `tile` rows (the last one zero-padded), so
    every matmul has one shape."""
    rows = x.shape[0]
    padded = x.new_zeros((-(-rows // tile) * tile, x.shape[1]))
    padded[:rows] = x
    out = torch.cat([F.linear(part, weight, bias) for part in padded.split(tile)])
    return out[:rows]


@functools.cache
def flashinfer_import_error() -> str | None:
    """None when `import flashinfer` works here, else why it does not (asked once)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA/driver setup under it
        return f"{type(exc).__name__}: {exc}"
    return None


class FlashInferOps(TorchOps):
    """FlashInfer's fused kernels; falls back to the torch op where a kernel cannot take the
    input (float32, odd widths). Numerics differ from TorchOps in the last bits: RMSNorm
    multiplies by the weight before rounding, RoPE rotates in float32."""

    name = "flashinfer"

    def __init__(self, batch_invariant: bool = False) -> None:
        import flashinfer

        super().__init__()
        self._fi = flashinfer
        self._cos_sin: dict[int, torch.Tensor] = {}
        self.batch_invariant = batch_invariant

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """In the batch-invariant mode, in tiles of exactly CUDA_INVARIANT_ROWS rows: cuBLAS
        picks its kernel (and any split of the sum) by the shape, so one shape for every
        call gives every row the same kernel whatever the step's row count (unverified on a
        GPU so far: docs/gpu.md)."""
        if not self.batch_invariant or x.dim() != 2:
            return super().linear(x, weight, bias)
        return tiled_linear(x, weight, bias, CUDA_INVARIANT_ROWS)

    @staticmethod
    def _fits(x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._fits(x):
            return rms_norm(x, weight, eps)
        if x.dim() == 2:
            return self._fi.rmsnorm(x.contiguous(), weight, eps)
        # Per-head norms (Qwen3 q/k norm): fold the heads into rows.
        shape = x.shape
        return self._fi.rmsnorm(x.reshape(-1, shape[-1]).contiguous(), weight, eps).view(shape)

    def cos_sin_cache(self, rope) -> torch.Tensor:
        """float32 [max_positions, rotary dims]: cos of each frequency, then sin, as
        `apply_rope_with_cos_sin_cache` wants (fewer than head_dim: a partial rotary); built
        from the float32 inverse frequencies (rope scaling already folded in), so it is finer
        than the model-dtype tables."""
        cache = self._cos_sin.get(id(rope))
        if cache is None:
            cache = rope.float32_cos_sin().to(rope.cos.device)
            self._cos_sin[id(rope)] = cache
        return cache

    def rope(self, rope, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             tables=None):
        if not self._fits(q):
            return super().rope(rope, q, k, positions, tables)
        tokens, head_dim = q.shape[0], q.shape[-1]
        # [T, H, D] views of the fused qkv output fold into [T, H * D] without a copy.
        q_out, k_out = self._fi.apply_rope_with_cos_sin_cache(
            positions, q.reshape(tokens, -1), k.reshape(tokens, -1), head_dim,
            self.cos_sin_cache(rope), is_neox=True,
        )
        return q_out.view(tokens, -1, head_dim), k_out.view(tokens, -1, head_dim)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel wants each row 16-byte aligned.
        if not self._fits(x) or (x.shape[-1] * x.element_size()) % 16:
            return super().silu_and_mul(x)
        return self._fi.silu_and_mul(x.contiguous())


def make_ops(name: str, device: torch.device, batch_invariant: bool = False) -> TorchOps:
    """The ops that go with an attention backend: flashinfer's with flashinfer, the compiled
    CPU kernels on a CPU where they build, plain torch otherwise. batch_invariant: see
    CpuKernelOps and FlashInferOps; on a CPU it needs the compiled kernels (ValueError)."""
    if name == "flashinfer":
        return FlashInferOps(batch_invariant)
    if device.type == "cpu":
        from engine.kernels.cpu_kernels import enabled, kernels

        compiled = kernels()
        if compiled is not None:
            return CpuKernelOps(compiled, batch_invariant)
        if batch_invariant and not enabled():
            raise ValueError("--batch-invariant needs the engine's CPU kernels, which "
                             "SLUICE_CPU_KERNELS switches off; unset it")
        if batch_invariant:
            raise ValueError("--batch-invariant needs the engine's CPU kernels, which are not "
                             "available here (see the log; `python -m engine.kernels.cpu_kernels` "
                             "builds them)")
    elif batch_invariant:
        raise ValueError(f"--batch-invariant runs on a CPU or with flashinfer, not {device}")
    return TorchOps()


def top_k_top_p_sample(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor | None:
    """Draw one token per row of temperature-scaled `logits` [R, V] under per-row top-k
    (V where disabled) and top-p, with FlashInfer's fused rejection-sampling kernel (top-k
    first, then top-p on the renormalised rest: the torch sampler's semantics). Only for rows
    without a seeded generator: the kernel draws from the device's global generator, so a
    seed could not make its row reproducible. None when the kernel does not apply here."""
    if not logits.is_cuda or flashinfer_import_error() is not None:
        return None
    import flashinfer.sampling

    probs = logits.float().softmax(dim=-1)
    if bool((top_k >= logits.shape[-1]).all()) and bool((top_p >= 1.0).all()):
        tokens = flashinfer.sampling.sampling_from_probs(probs)  # no filter at all
    else:
        tokens = flashinfer.sampling.top_k_top_p_sampling_from_probs(
            probs,
            top_k.to(device=logits.device, dtype=torch.int32),
            top_p.to(device=logits.device, dtype=torch.float32),
        )
    return tokens.long()
