"""Attention over the paged KV cache with FlashInfer's kernels: the CUDA path.

Cache layout: per layer, one K and one V tensor in FlashInfer's NHD layout,
[num_pages + 1, page_size, kv_heads, head_dim]. Flattened over the first two dimensions it
is the torch backend's [slot, kv_heads, head_dim], so new K/V go in by slot
(page * page_size + offset) the same way. The extra last page is scratch: padding rows of
a CUDA-graph decode batch write and read there, never in a sequence's pages.

Once per step, `prepare` turns the chunks into FlashInfer's page-table metadata
(`build_step_plan`, a pure function, tested on CPU) and calls `plan()` on the wrappers;
every layer's `attend` then reuses those plans. Chunks of one token (decodes) go to
BatchDecodeWithPagedKVCacheWrapper; longer chunks (prefill, chunked prefill, prefill after
a prefix-cache hit) to BatchPrefillWithPagedKVCacheWrapper with a causal mask, which
FlashInfer aligns to the end of the context, so a chunk that starts at position s attends
to all s earlier tokens and causally within itself. A step that mixes both runs both on
their own rows of the batch.

flashinfer is imported only when the backend is built (on CUDA); the metadata builder and
this module import without it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec
import torch

from engine.layers.config import PLAIN_ATTENTION, LayerAttention
from engine.request.batch import ScheduledChunk

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace
# The decode plan's disable_split_kv came in FlashInfer 0.4.0. Asked by version, not by
# plan()'s signature: from 0.6.15 on that is (*deprecated_positional_args, **kwargs).
SPLIT_KV_SWITCH_SINCE = (0, 4, 0)
# The attention kernels for prefill and for tensor-core decode: FlashAttention-2's, one
# compiled module for both (benchmarks/gpukit/kernels.py builds it ahead of time). `auto`
# would take FA3's on Hopper: a second, much longer compile, for small gains at head dim 64.
ATTENTION_KERNELS = "fa2"


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "0.6.14" -> (0, 6, 14), "0.7.0rc1" ->
    (0, 7, 0)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in match.group().split(".")) if match else ()


def decode_uses_tensor_cores(num_heads: int, num_kv_heads: int, batch_invariant: bool) -> bool:
    """The tensor-core decode path (FlashInfer's prefill kernel planned for one query row per
    sequence) for GQA groups wider than 4, which the CUDA-core kernel does not cover, and
    always in the batch-invariant mode: only that path's planner takes disable_split_kv;
    the CUDA-core planner splits the KV sequence by the batch's size whatever it is told."""
    return batch_invariant or num_heads // num_kv_heads > 4


# ---------------------------------------------------------------- page-table metadata (pure)


class PageTable(msgspec.Struct):
    """FlashInfer's CSR page table for one group of chunks (all prefill, or all decode).

    Sequence i of the group owns query rows qo_indptr[i]:qo_indptr[i+1] of the group's q,
    and pages kv_indices[kv_indptr[i]:kv_indptr[i+1]]; its last page holds
    kv_last_page_len[i] tokens (1..page_size). `rows` are the group's rows in the step's
    flattened batch, in order.
    """

    rows: list[int]
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    kv_last_page_len: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.kv_last_page_len)


class StepPlan(msgspec.Struct):
    slot_mapping: list[int]  # [T] the cache slot of each new token's K/V
    prefill: PageTable | None  # chunks of more than one token
    decode: PageTable | None  # chunks of one token


def _empty_table() -> PageTable:
    return PageTable([], [0], [0], [], [])


def _add_entry(table: PageTable, pages: list[int], rows: range, end: int, page_size: int
               ) -> None:
    """Query rows `rows` attending to the first `end` tokens of a sequence's pages."""
    used = -(-end // page_size)  # pages holding tokens 0..end-1
    table.rows.extend(rows)
    table.qo_indptr.append(table.qo_indptr[-1] + len(rows))
    table.kv_indices.extend(pages[:used])
    table.kv_indptr.append(len(table.kv_indices))
    table.kv_last_page_len.append(end - (used - 1) * page_size)


def build_step_plan(chunks: Sequence[ScheduledChunk], page_size: int,
                    per_token: bool = False) -> StepPlan:
    """The step's page tables, from the chunks alone (their sequences' page lists and
    positions). Each chunk attends to its sequence's first start + num_tokens tokens.
    per_token (the batch-invariant mode): every token is a decode entry of its own over its
    context so far, so one kernel, planned alike, attends every row of every step."""
    slots: list[int] = []
    prefill, decode = _empty_table(), _empty_table()
    row = 0
    for chunk in chunks:
        pages = chunk.seq.pages
        end = chunk.start + chunk.num_tokens
        if len(pages) < -(-end // page_size):
            raise ValueError(
                f"sequence {chunk.seq.request_id} has {len(pages)} pages for {end} tokens"
            )
        for pos in range(chunk.start, end):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        if per_token:
            for i in range(chunk.num_tokens):
                _add_entry(decode, pages, range(row + i, row + i + 1), chunk.start + i + 1,
                           page_size)
        else:
            table = decode if chunk.num_tokens == 1 else prefill
            _add_entry(table, pages, range(row, row + chunk.num_tokens), end, page_size)
        row += chunk.num_tokens
    return StepPlan(
        slot_mapping=slots,
        prefill=prefill if prefill.num_seqs else None,
        decode=decode if decode.num_seqs else None,
    )


def pad_decode(plan: StepPlan, batch_size: int, scratch_page: int, page_size: int) -> StepPlan:
    """A decode-only plan padded to `batch_size` sequences, for a CUDA graph captured at that
    size: each padding row writes its K/V to the scratch page's first slot and attends to
    that one key, so it can touch nothing of any sequence."""
    if plan.prefill is not None:
        raise ValueError("only decode-only steps run as CUDA graphs")
    table = plan.decode or _empty_table()
    pad = batch_size - table.num_seqs
    if pad < 0:
        raise ValueError(f"{table.num_seqs} decodes do not fit a graph of {batch_size}")
    start = len(table.rows)
    last = table.kv_indptr[-1]
    return StepPlan(
        slot_mapping=plan.slot_mapping + [scratch_page * page_size] * pad,
        prefill=None,
        decode=PageTable(
            rows=table.rows + list(range(start, start + pad)),
            qo_indptr=table.qo_indptr + [table.qo_indptr[-1] + i + 1 for i in range(pad)],
            kv_indptr=table.kv_indptr + [last + i + 1 for i in range(pad)],
            kv_indices=table.kv_indices + [scratch_page] * pad,
            kv_last_page_len=table.kv_last_page_len + [1] * pad,
        ),
    )


# ---------------------------------------------------------------- the backend


class Segment(msgspec.Struct):
    """One wrapper's share of a step: its planned wrapper and its rows of the batch
    (None: every row, in order)."""

    wrapper: object
    rows: torch.Tensor | slice | None


class FlashInferMetadata(msgspec.Struct):
    slot_mapping: torch.Tensor  # [T] long, on the device
    prefill: Segment | None
    decode: Segment | None
    # > 0: this step replays the decode CUDA graph captured at this batch size; its tensors
    # are that graph's static buffers, refilled by `prepare`.
    graph_batch_size: int = 0


def _rows(rows: list[int], total: int, device) -> torch.Tensor | slice | None:
    if len(rows) == total:
        return None
    if rows[-1] - rows[0] + 1 == len(rows):
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long, device=device)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        batch_invariant: bool = False,
        attention: LayerAttention = PLAIN_ATTENTION,
    ) -> None:
        """batch_invariant: every row through the tensor-core decode kernel, one entry per token
        (build_step_plan's per_token), with the split of the KV sequence over thread blocks
        turned off, since FlashInfer sizes that split by the batch. attention: how every
        layer attends (one plan serves all layers, so they must agree; no sinks): a window
        becomes FlashInfer's window_left (the keys before the query's own), with the score
        scale and soft-cap (unverified on a GPU so far: docs/gpu.md)."""
        import flashinfer

        # The device is the selector's to check (engine.attention.selector); the kernels run
        # on CUDA only.
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FlashInfer's attention kernels take float16/bfloat16, not {dtype}")
        self._fi = flashinfer
        self.page_size = page_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.scratch_page = num_pages
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # One float workspace for every wrapper: their runs follow one another on one stream.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode_tensor_cores = decode_uses_tensor_cores(num_heads, num_kv_heads,
                                                            batch_invariant)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=ATTENTION_KERNELS)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores,
            backend=ATTENTION_KERNELS)
        self._graph_meta: dict[int, FlashInferMetadata] = {}
        self.batch_invariant = batch_invariant
        if attention.sinks:
            raise ValueError("the flashinfer backend does not plan attention sinks")
        self._layer_plan_options = {
            "window_left": attention.window - 1 if attention.window is not None else -1,
            "logits_soft_cap": attention.softcap,
            "sm_scale": attention.scale,
        }
        self._decode_plan_options = dict(self._layer_plan_options)
        if batch_invariant:
            if release(flashinfer.__version__) < SPLIT_KV_SWITCH_SINCE:
                raise ValueError(
                    f"--batch-invariant needs FlashInfer 0.4.0 or newer (its decode plan's "
                    f"disable_split_kv); this is {flashinfer.__version__}")
            self._decode_plan_options["disable_split_kv"] = True

    # ---------------------------------------------------------------- planning

    def prepare(self, chunks: list[ScheduledChunk]) -> FlashInferMetadata:
        plan = build_step_plan(chunks, self.page_size, per_token=self.batch_invariant)
        if plan.prefill is None and plan.decode is not None and self._graph_meta:
            size = self.graph_size_for(plan.decode.num_seqs)
            if size:
                return self._prepare_graph(plan, size)
        total = len(plan.slot_mapping)
        meta = FlashInferMetadata(
            slot_mapping=torch.tensor(plan.slot_mapping, dtype=torch.long).to(self.device),
            prefill=None,
            decode=None,
        )
        if plan.prefill is not None:
            self._plan_prefill(plan.prefill)
            meta.prefill = Segment(
                self.prefill_wrapper, _rows(plan.prefill.rows, total, self.device)
            )
        if plan.decode is not None:
            self._plan_decode(self.decode_wrapper, plan.decode)
            meta.decode = Segment(self.decode_wrapper, _rows(plan.decode.rows, total, self.device))
        return meta

    def _plan_prefill(self, table: PageTable) -> None:
        self.prefill_wrapper.plan(
            _i32(table.qo_indptr), _i32(table.kv_indptr), _i32(table.kv_indices),
            _i32(table.kv_last_page_len), self.num_heads, self.num_kv_heads, self.head_dim,
            self.page_size, causal=True, q_data_type=self.dtype, kv_data_type=self.dtype,
            **self._layer_plan_options,
        )

    def _plan_decode(self, wrapper, table: PageTable) -> None:
        wrapper.plan(
            _i32(table.kv_indptr), _i32(table.kv_indices), _i32(table.kv_last_page_len),
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            q_data_type=self.dtype, kv_data_type=self.dtype, **self._decode_plan_options,
        )

    # ---------------------------------------------------------------- CUDA graphs

    def enable_decode_graphs(self, batch_sizes: list[int], max_model_len: int) -> None:
        """Give each graph batch size its own decode wrapper over fixed buffers (FlashInfer's
        CUDA-graph mode) and static metadata; `prepare` then refills those for every
        decode-only step that fits one of the sizes."""
        pages_per_seq = -(-max_model_len // self.page_size)
        for size in batch_sizes:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.decode_tensor_cores, backend=ATTENTION_KERNELS,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32,
                                                   device=self.device),
                paged_kv_indices_buffer=torch.zeros(size * pages_per_seq, dtype=torch.int32,
                                                    device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32,
                                                          device=self.device),
            )
            self._graph_meta[size] = FlashInferMetadata(
                slot_mapping=torch.zeros(size, dtype=torch.long, device=self.device),
                prefill=None,
                decode=Segment(wrapper, None),
                graph_batch_size=size,
            )

    def graph_size_for(self, num_seqs: int) -> int:
        """The smallest captured batch size that holds num_seqs decodes; 0 when none does."""
        return min((s for s in self._graph_meta if s >= num_seqs), default=0)

    def capture_metadata(self, batch_size: int) -> FlashInferMetadata:
        """The static metadata of one graph size, planned for padding rows only: what a
        graph is captured (and warmed up) with."""
        return self._prepare_graph(StepPlan([], None, None), batch_size)

    def _prepare_graph(self, plan: StepPlan, size: int) -> FlashInferMetadata:
        padded = pad_decode(plan, size, self.scratch_page, self.page_size)
        meta = self._graph_meta[size]
        meta.slot_mapping.copy_(torch.tensor(padded.slot_mapping, dtype=torch.long))
        self._plan_decode(meta.decode.wrapper, padded.decode)
        return meta

    # ---------------------------------------------------------------- compute

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: FlashInferMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        cache = (k_cache, v_cache)
        segments = [s for s in (meta.prefill, meta.decode) if s is not None]
        if len(segments) == 1 and segments[0].rows is None:
            return segments[0].wrapper.run(q, cache)
        out = torch.empty_like(q)
        for seg in segments:
            out[seg.rows] = seg.wrapper.run(q[seg.rows].contiguous(), cache)
        return out
