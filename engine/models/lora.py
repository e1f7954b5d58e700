"""LoRA in the model's building blocks: the low-rank products added to a linear's output,
grouped by adapter, for every family (they all run their linears through `ops.linear`).

`LoraOps` wraps the model's ops. Each step the runner tells it which rows of the flattened
batch belong to which adapter (`set_step`); `linear` then runs the base matmul once over
every row and, for each adapter present in the step, one pair of matmuls over that
adapter's rows (gathered with index_select, added back with index_add_): never a loop per
row. The same code runs on CUDA (the row indices are built once per step on the device).

Fused weights (q/k/v, gate/up) take one A per adapter stacked over the parts and one
block-diagonal B, so a fused linear costs one low-rank pair per adapter too. The scaling
(lora_alpha / r, or / sqrt(r) for rsLoRA) is folded into B when the adapter is installed.
"""

from __future__ import annotations

import msgspec
import torch
import torch.nn.functional as F

# A decoder layer's linear weights an adapter may target: HF module name -> (the layer's
# fused attribute, the part of it; None: the whole fused weight, as Phi-3 stores it).
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("qkv_weight", 0),
    "k_proj": ("qkv_weight", 1),
    "v_proj": ("qkv_weight", 2),
    "qkv_proj": ("qkv_weight", None),
    "o_proj": ("o_weight", 0),
    "gate_proj": ("gate_up_weight", 0),
    "up_proj": ("gate_up_weight", 1),
    "gate_up_proj": ("gate_up_weight", None),
    "down_proj": ("down_weight", 0),
}


class LinearSite(msgspec.Struct, frozen=True):
    """One fused linear of the model an adapter may add to: its row blocks (q, k, v or
    gate, up; one for o and down) and its input width."""

    weight_id: int
    parts: tuple[int, ...]  # output rows of each part, in order
    in_features: int


def linear_sites(model) -> dict[tuple[int, str], LinearSite]:
    """(layer, attribute) -> site, for every dense linear of the model's decoder layers (an
    MoE layer has no gate_up/down: its experts take no adapter)."""
    sites = {}
    for i, layer in enumerate(model.layers):
        kv = model.kv_size
        for attr in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            weight = getattr(layer, attr, None)
            if weight is None:
                continue
            out, width = int(weight.shape[0]), int(weight.shape[1])
            if attr == "qkv_weight":
                parts = (out - 2 * kv, kv, kv)
            elif attr == "gate_up_weight":
                parts = (out // 2, out // 2)
            else:
                parts = (out,)
            sites[(i, attr)] = LinearSite(id(weight), parts, width)
    return sites


class LowRank(msgspec.Struct):
    """One adapter's product on one fused linear: delta = (x @ a.T) @ b.T."""

    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [out, sum of ranks], block-diagonal over the parts, scaling folded in


def fuse(site: LinearSite, parts: dict[int | None, tuple[torch.Tensor, torch.Tensor, float]],
         dtype: torch.dtype, device: torch.device) -> LowRank:
    """The parts an adapter targets on `site` (part index -> (A [r, in], B [out_part, r],
    scaling)) as one stacked A and one block-diagonal B."""
    bounds = [0]
    for rows in site.parts:
        bounds.append(bounds[-1] + rows)
    a_blocks, placed = [], []
    for part, (a, b, scaling) in sorted(parts.items(), key=lambda kv: -1 if kv[0] is None
                                        else kv[0]):
        lo, hi = (0, bounds[-1]) if part is None else (bounds[part], bounds[part + 1])
        a_blocks.append(a.to(torch.float32))
        placed.append((lo, hi, b.to(torch.float32) * scaling))
    rank = sum(a.shape[0] for a in a_blocks)
    b_full = torch.zeros(bounds[-1], rank, dtype=torch.float32)
    col = 0
    for (lo, hi, b), a in zip(placed, a_blocks, strict=True):
        b_full[lo:hi, col : col + a.shape[0]] = b
        col += a.shape[0]
    a_full = torch.cat(a_blocks)
    return LowRank(a_full.to(dtype=dtype, device=device), b_full.to(dtype=dtype, device=device))


class LoraOps:
    """The model's ops with LoRA added to its linears (see the module's docstring); every
    other op is the wrapped one's."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._products: dict[int, dict[int, LowRank]] = {}  # weight id -> adapter id -> ...
        # This step's (adapter id, rows of the flattened batch, or None for all of them).
        self._groups: list[tuple[int, torch.Tensor | None]] = []

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    @property
    def name(self) -> str:
        return self._inner.name + "+lora"

    def install(self, adapter_id: int, products: dict[int, LowRank]) -> None:
        """Make an adapter's products (by weight id) available to steps."""
        for weight_id, product in products.items():
            self._products.setdefault(weight_id, {})[adapter_id] = product

    def remove(self, adapter_id: int) -> None:
        for per_adapter in self._products.values():
            per_adapter.pop(adapter_id, None)

    def set_step(self, row_adapters: list[tuple[int, int]], num_rows: int,
                 device: torch.device) -> None:
        """row_adapters: (adapter id, number of rows) runs in row order; adapter 0 is the
        base model. Rows of one adapter are gathered into one group."""
        by_adapter: dict[int, list[int]] = {}
        row = 0
        for adapter_id, count in row_adapters:
            if adapter_id:
                by_adapter.setdefault(adapter_id, []).extend(range(row, row + count))
            row += count
        self._groups = [
            (adapter_id, None if len(rows) == num_rows else
             torch.tensor(rows, dtype=torch.long, device=device))
            for adapter_id, rows in by_adapter.items()
        ]

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._inner.linear(x, weight, bias)
        products = self._products.get(id(weight)) if self._groups else None
        if not products:
            return out
        for adapter_id, rows in self._groups:
            product = products.get(adapter_id)
            if product is None:
                continue  # this adapter leaves this linear alone
            if rows is None:
                out = out + F.linear(F.linear(x, product.a), product.b).to(out.dtype)
            else:
                delta = F.linear(F.linear(x.index_select(0, rows), product.a), product.b)
                out.index_add_(0, rows, delta.to(out.dtype))
        return out
