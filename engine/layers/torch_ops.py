"""`TorchOps`, the reference ops: plain torch, every device, the CPU path. Its code is the
model's original code moved here unchanged, so CPU numerics stay exactly what the
transformers reference test pins; the other ops (`cpu_ops.py`, `flashinfer_ops.py`) fall
back to it for what their kernels do not take."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.safetensors_weights import in_mapped_file


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
