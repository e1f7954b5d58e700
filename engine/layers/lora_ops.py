"""LoRA in the model's building blocks: the low-rank products added to a linear's output,
grouped by adapter, for every family (they all run their linears through `ops.linear`).

`LoraOps` wraps the model's ops. Each step the runner tells it which rows of the flattened
batch belong to which adapter (`set_step`); `linear` then runs the base matmul once over
every row, and the adapters present in the step as one segmented product: their A's
stacked (x @ A_all.T gives every adapter's low-rank input for every row), a row-by-column
mask keeping each row's own adapter's columns (zero for base-model rows), and their B's side
by side (one more matmul). Two matmuls per linear whatever the number of adapters, never a
loop per row or per adapter; the stacks are built once per set of adapters and kept. The
same code runs on CUDA (the row-to-adapter map is built once per step on the device).

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


class _Stack(msgspec.Struct):
    """The products of the adapters present in a step on one linear, side by side."""

    a: torch.Tensor  # [sum of their ranks, in]
    b: torch.Tensor  # [out, sum of their ranks]
    owner: torch.Tensor  # [sum of ranks]: the adapter id of each rank column
    key: tuple  # (adapter id, rank) per adapter: linears with one key share a mask


# Distinct sets of adapters whose stacks are kept (a set recurs step after step).
MAX_STACKED_SETS = 4


class LoraOps:
    """The model's ops with LoRA added to its linears (see the module's docstring); every
    other op is the wrapped one's."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._products: dict[int, dict[int, LowRank]] = {}  # weight id -> adapter id -> ...
        self._present: tuple[int, ...] = ()  # this step's adapters (0, the base, left out)
        self._row_adapter: torch.Tensor | None = None  # [rows]: each row's adapter id
        self._one_for_all = False  # every row of the step runs one adapter
        self._stacks: dict[tuple, _Stack] = {}  # (weight id, adapters) -> stack
        self._masks: dict[tuple, torch.Tensor] = {}  # this step's, by _Stack.key

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    @property
    def name(self) -> str:
        return self._inner.name + "+lora"

    def install(self, adapter_id: int, products: dict[int, LowRank]) -> None:
        """Make an adapter's products (by weight id) available to steps."""
        for weight_id, product in products.items():
            self._products.setdefault(weight_id, {})[adapter_id] = product
        self._stacks.clear()

    def remove(self, adapter_id: int) -> None:
        for per_adapter in self._products.values():
            per_adapter.pop(adapter_id, None)
        self._stacks.clear()

    def set_step(self, row_adapters: list[tuple[int, int]], num_rows: int,
                 device: torch.device) -> None:
        """row_adapters: (adapter id, number of rows) runs in row order; adapter 0 is the
        base model."""
        present = sorted({a for a, n in row_adapters if a and n})
        self._present = tuple(present)
        self._masks = {}
        self._one_for_all = len(present) == 1 and all(a for a, n in row_adapters if n)
        if not present or self._one_for_all:
            self._row_adapter = None
            return
        ids = [a for a, n in row_adapters for _ in range(n)]
        self._row_adapter = torch.tensor(ids, dtype=torch.long, device=device)
        if len({k[1] for k in self._stacks}) > MAX_STACKED_SETS and \
                not any(k[1] == self._present for k in self._stacks):
            self._stacks.clear()

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        out = self._inner.linear(x, weight, bias)
        products = self._products.get(id(weight)) if self._present else None
        if not products:
            return out
        present = tuple(a for a in self._present if a in products)
        if not present:
            return out  # no adapter of this step changes this linear
        if self._one_for_all:
            product = products[present[0]]
            return out + F.linear(F.linear(x, product.a), product.b).to(out.dtype)
        # Every adapter's low-rank input at once, each row keeping only its adapter's
        # columns, then every adapter's B at once: two matmuls, whatever the adapters.
        stack = self._stack(id(weight), present, products)
        low = F.linear(x, stack.a) * self._mask(stack, x.dtype)
        return out + F.linear(low, stack.b).to(out.dtype)

    def _stack(self, weight_id: int, present: tuple[int, ...],
               products: dict[int, LowRank]) -> _Stack:
        stack = self._stacks.get((weight_id, present))
        if stack is None:
            parts = [products[a] for a in present]
            owner = torch.cat([torch.full((p.a.shape[0],), a, dtype=torch.long)
                               for a, p in zip(present, parts, strict=True)])
            stack = _Stack(torch.cat([p.a for p in parts]), torch.cat([p.b for p in parts], 1),
                           owner.to(parts[0].a.device),
                           tuple((a, p.a.shape[0]) for a, p in zip(present, parts, strict=True)))
            self._stacks[(weight_id, present)] = stack
        return stack

    def _mask(self, stack: _Stack, dtype: torch.dtype) -> torch.Tensor:
        """[rows, sum of ranks]: 1 where the column belongs to the row's adapter."""
        mask = self._masks.get(stack.key)
        if mask is None:
            mask = (self._row_adapter[:, None] == stack.owner[None, :]).to(dtype)
            self._masks[stack.key] = mask
        return mask
