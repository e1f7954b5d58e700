"""`FlashInferOps`: `TorchOps` with FlashInfer's fused CUDA kernels (RMSNorm, RoPE from a
cos/sin cache, SiLU-and-mul) for fp16/bf16 models on CUDA; it is only ever built on CUDA,
and importing this module never imports flashinfer.

`top_k_top_p_sample` is the sampler's door to FlashInfer's fused top-k/top-p kernel; it
answers None wherever the kernel does not apply, and the sampler then uses its own path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.layers.torch_ops import TorchOps, rms_norm

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
