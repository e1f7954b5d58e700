"""Attention over the paged KV cache in plain torch: the CPU path and the reference.

Cache layout: per layer, one K and one V tensor of shape [num_pages * page_size, kv_heads,
head_dim], addressed by slot = page * page_size + offset. Decodes (one new token each) are
attended in one padded batch; each prefill chunk is attended on its own, because padding a
long chunk to the batch would multiply the work.

A context is read by whole pages (`index_select` of page rows), not token by token: one
contiguous copy per page instead of an indexed copy per token, several times faster on CPU.
The step's metadata is built with numpy over the batch, once per step, since it is Python
work every layer waits for.

Given the engine's compiled CPU kernels (`engine.kernels.cpu_kernels`), the decode batch skips the
gather altogether: `decode_attention` reads each sequence's pages where they lie, a narrow
cache's too (--kv-cache-dtype, engine.attention.kv_dtype: widened in registers as read).

Layers that attend other than plainly (engine.layers.config.LayerAttention: a sliding
window, a local chunk, a score scale, soft-capping, attention sinks) take `_attend_special`:
the same pages, gathered, under an explicit mask of causality, window and chunk, through
SDPA or, for soft-caps and sinks, through the scores written out as transformers' eager
attention computes them. Where every layer is windowed, the scheduler releases the pages wholly
behind the window (engine.step.scheduler); their ids stay in the page table, and since the mask
hides every key there, whatever those pages hold by then is never seen.

In the batch-invariant mode every token of the step is attended as a decode row of its own
(context: its sequence's tokens up to and including it), by that one kernel, which sums
each (token, head) over the keys in order. A prefill chunk's tokens then get exactly the
numbers they would get decoded one by one, or prefilled in other chunks, or after a
prefix-cache hit; SDPA's blocking, which follows the chunk's length, never enters.
"""

from __future__ import annotations

import math
import mmap

import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.kv_dtype import KvCacheDtype, dequantize, quantize
from engine.layers.config import PLAIN_ATTENTION, LayerAttention
from engine.request.batch import ScheduledChunk


def zeros_on_first_write(shape: tuple[int, ...], dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in an anonymous mapping, whose pages the kernel makes resident only
    when first written (read before then, they are the one shared zero page). The pool's
    resident memory is then the KV that requests have used, not --kv-cache-memory-gb from
    the start: torch.zeros writes every byte of it at once."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def narrow_kernels_take(kernels, kv: KvCacheDtype | None) -> bool:
    """Whether the compiled decode kernel reads this cache: the engine's own dtype always,
    a narrow one where the build widens it as read (`narrow_kv`; else the torch path)."""
    return kv is None or bool(getattr(kernels, "narrow_kv", False))


class PrefillSlice(msgspec.Struct):
    rows: slice  # this chunk's rows in the flattened batch
    start: int  # tokens already in the cache before this chunk
    context_pages: torch.Tensor | None  # pages of the whole context; None when start == 0
    causal_mask: torch.Tensor | None  # [n, start + n] bool; None when start == 0


class TorchAttentionMetadata(msgspec.Struct):
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_rows: torch.Tensor | None  # [B] rows of single-token chunks
    # The decodes' page table, padded with page 0, as [B * P] (the gather) or [B, P] (the
    # kernel), and which keys are real: a mask (the gather) or the context lengths (kernel).
    decode_pages: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [B, 1, 1, P * page_size] True where a key is real
    decode_lens: torch.Tensor | None  # [B]
    prefills: list[PrefillSlice]
    # For layers that attend specially (`_attend_special`): the decodes' page table [B, P]
    # and context lengths [B] on the device, and the masks built so far, by window.
    decode_table: torch.Tensor | None = None
    decode_context: torch.Tensor | None = None
    masks: dict = {}


class TorchAttentionBackend:
    name = "torch"

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kernels=None,
        batch_invariant: bool = False,
        layers: tuple[LayerAttention, ...] = (),
        kv: KvCacheDtype | None = None,
    ) -> None:
        """kernels: the compiled CPU kernels module, or None for plain torch. They take
        float32 and bfloat16 engines (float16 stays on the torch path), and their caches
        in the engine's dtype or narrow (kv). batch_invariant needs
        them (ValueError). layers: how each layer attends, where any differs from plain
        causal attention (empty: none does). kv: a cache stored narrower than dtype
        (engine.attention.kv_dtype; --kv-cache-dtype), None: in dtype."""
        if kv is not None and batch_invariant:
            raise ValueError("--batch-invariant: its kernels read a float32 or bfloat16 KV "
                             "cache only; drop --kv-cache-dtype")
        self.page_size = page_size
        self.special = [spec if spec != PLAIN_ATTENTION else None for spec in layers]
        self.device = device
        self.dtype, self.kv = dtype, kv
        self.kernels = (kernels if dtype in (torch.float32, torch.bfloat16)
                        and narrow_kernels_take(kernels, kv) else None)
        if batch_invariant and self.kernels is None:
            raise ValueError("--batch-invariant needs the engine's CPU kernels and a float32 "
                             "or bfloat16 KV cache")
        self.batch_invariant = batch_invariant
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        stored = dtype if kv is None else kv.dtype
        self.k_cache = [zeros_on_first_write(shape, stored, device) for _ in range(num_layers)]
        self.v_cache = [zeros_on_first_write(shape, stored, device) for _ in range(num_layers)]
        # The same memory seen as one row per page, for gathering whole pages.
        self._k_pages = [c.view(num_pages, -1) for c in self.k_cache]
        self._v_pages = [c.view(num_pages, -1) for c in self.v_cache]

    # ---------------------------------------------------------------- metadata

    def prepare(self, chunks: list[ScheduledChunk]) -> TorchAttentionMetadata:
        size = self.page_size
        slots = np.empty(sum(c.num_tokens for c in chunks), dtype=np.int64)
        prefills = []
        decode_rows, decode_pages, decode_lens = [], [], []
        row = 0
        for chunk in chunks:
            pages, start, n = chunk.seq.pages, chunk.start, chunk.num_tokens
            # Each token a decode row: see the module's docstring. A speculative draft's
            # too: a few decode rows cost less than a masked prefill over the whole context,
            # and get the numbers plain decoding would (engine.step.spec_decode).
            if self.batch_invariant or chunk.draft:
                pos = np.arange(start, start + n)
                slots[row : row + n] = np.asarray(pages)[pos // size] * size + pos % size
                decode_rows.extend(range(row, row + n))
                decode_pages.extend([pages] * n)
                decode_lens.extend(range(start + 1, start + n + 1))
            elif n == 1 and start > 0:
                slots[row] = pages[start // size] * size + start % size
                decode_rows.append(row)
                decode_pages.append(pages)
                decode_lens.append(start + 1)
            else:
                pos = np.arange(start, start + n)
                slots[row : row + n] = np.asarray(pages)[pos // size] * size + pos % size
                prefills.append(self._prefill_slice(chunk, row))
            row += n
        meta = TorchAttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(self.device),
            decode_rows=None,
            decode_pages=None,
            decode_mask=None,
            decode_lens=None,
            prefills=prefills,
        )
        if decode_rows:
            self._add_decode_batch(meta, decode_rows, decode_pages, decode_lens)
        return meta

    def _prefill_slice(self, chunk: ScheduledChunk, row: int) -> PrefillSlice:
        rows = slice(row, row + chunk.num_tokens)
        if chunk.start == 0:
            return PrefillSlice(rows, 0, None, None)
        end = chunk.start + chunk.num_tokens
        query_pos = torch.arange(chunk.start, end).unsqueeze(1)
        key_pos = torch.arange(end).unsqueeze(0)
        used = chunk.seq.pages[: -(-end // self.page_size)]
        return PrefillSlice(
            rows,
            chunk.start,
            torch.tensor(used, dtype=torch.long).to(self.device),
            (key_pos <= query_pos).to(self.device),
        )

    def _add_decode_batch(
        self, meta: TorchAttentionMetadata, rows: list[int], pages: list[list[int]],
        lengths: list[int],
    ) -> None:
        size = self.page_size
        lens = np.asarray(lengths)
        counts = -(-lens // size)
        table = np.zeros((len(rows), int(counts.max())), dtype=np.int64)
        for i, (owned, count) in enumerate(zip(pages, counts.tolist(), strict=True)):
            table[i, :count] = owned[:count]
        meta.decode_rows = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(self.device)
        if any(self.special):
            meta.decode_table = torch.from_numpy(table).to(self.device)
            meta.decode_context = torch.from_numpy(lens.astype(np.int64)).to(self.device)
        if self.kernels is not None:
            meta.decode_pages = torch.from_numpy(table)
            meta.decode_lens = torch.from_numpy(lens.astype(np.int64))
            return
        mask = np.arange(table.shape[1] * size)[None, :] < lens[:, None]
        meta.decode_pages = torch.from_numpy(table.reshape(-1)).to(self.device)
        meta.decode_mask = torch.from_numpy(mask[:, None, None, :]).to(self.device)

    def decode_kernel_inputs(self, layer: int, meta: TorchAttentionMetadata) -> tuple | None:
        """What the kernels' decode_layer needs to write this layer's new K/V and attend
        as `attend` would: (k_cache, v_cache, slots, page table, lengths, page size), and a
        narrow cache's K and V scales; None where `attend` would not run the decode kernel
        alone (a prefill in the step, a layer that attends specially, no kernels)."""
        if (self.kernels is None or meta.prefills or meta.decode_lens is None
                or (self.special and self.special[layer] is not None)):
            return None
        inputs = (self.k_cache[layer], self.v_cache[layer], meta.slot_mapping,
                  meta.decode_pages, meta.decode_lens, self.page_size)
        if self.kv is None:
            return inputs
        return (*inputs, self.kv.k_scales[layer], self.kv.v_scales[layer])

    # ---------------------------------------------------------------- compute

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchAttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sinks: [heads] learned logits of a layer with attention sinks (gpt-oss)."""
        k, v = self._write(layer, k, v, meta.slot_mapping)
        # Each layer's pages with the scale its stored elements are read back with.
        ks, vs = (1.0, 1.0) if self.kv is None else (self.kv.k_scales[layer],
                                                     self.kv.v_scales[layer])
        k_pages, v_pages = (self._k_pages[layer], ks), (self._v_pages[layer], vs)
        spec = self.special[layer] if self.special else None
        if spec is not None:
            return self._attend_special(spec, q, k, v, meta, k_pages, v_pages, sinks)
        if not meta.prefills:  # a pure decode step: no scatter into a fresh output
            return self._attend_decodes(q, meta, k_pages, v_pages, k.shape[1:])
        out = torch.empty_like(q)
        for p in meta.prefills:
            out[p.rows] = self._attend_prefill(q[p.rows], k[p.rows], v[p.rows], p, k_pages,
                                               v_pages)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._attend_decodes(
                q[meta.decode_rows], meta, k_pages, v_pages, k.shape[1:]
            )
        return out

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        """The step's new K/V into the layer's cache; returns them as the cache now holds
        them (a narrow cache: stored and read back), so the chunk attends its own keys with
        the numbers a later step, another chunking or a prefix-cache hit reads."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        if self.kv is None:
            k_cache.index_copy_(0, slots, k)
            v_cache.index_copy_(0, slots, v)
            return k, v
        kv, out = self.kv, []
        for cache, x, scale in ((k_cache, k, kv.k_scales[layer]), (v_cache, v, kv.v_scales[layer])):
            stored = quantize(x, scale, kv.dtype)
            # index_copy_ has no float8 kernel on the CPU: the bytes are copied as they are.
            as_bytes = torch.uint8 if kv.one_byte else torch.int16
            cache.view(as_bytes).index_copy_(0, slots, stored.view(as_bytes))
            out.append(dequantize(stored, scale, self.dtype))
        return out[0], out[1]

    @staticmethod
    def _gather(pages_view: torch.Tensor, pages: torch.Tensor, head_shape) -> torch.Tensor:
        """Whole pages of one layer's cache -> [len(pages) * page_size, kv_heads, head_dim]."""
        return pages_view.index_select(0, pages).view(-1, *head_shape)

    def _read(self, layer_pages: tuple[torch.Tensor, float], pages: torch.Tensor,
              head_shape) -> torch.Tensor:
        """`_gather` of (pages view, scale), in the engine's dtype: a narrow cache's pages
        widened as gathered, never the whole cache at once."""
        view, scale = layer_pages
        rows = self._gather(view, pages, head_shape)
        return rows if self.kv is None else dequantize(rows, scale, self.dtype)

    def _attend_prefill(self, q, k, v, p: PrefillSlice, k_pages, v_pages) -> torch.Tensor:
        # [n, H, D] -> [1, H, n, D]
        qh = q.transpose(0, 1).unsqueeze(0)
        if p.context_pages is None:
            kh = k.transpose(0, 1).unsqueeze(0)
            vh = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:
            end = p.causal_mask.shape[1]
            kh = self._read(k_pages, p.context_pages, k.shape[1:])[:end]
            vh = self._read(v_pages, p.context_pages, v.shape[1:])[:end]
            kh, vh = kh.transpose(0, 1).unsqueeze(0), vh.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=p.causal_mask, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _attend_decodes(self, q, meta: TorchAttentionMetadata, k_pages, v_pages, head_shape):
        """q: [B, H, D], the decode rows only -> [B, H, D]."""
        if self.kernels is not None:
            k_cache = k_pages[0].view(-1, *head_shape)
            v_cache = v_pages[0].view(-1, *head_shape)
            if self.kv is None:
                return self.kernels.decode_attention(
                    q, k_cache, v_cache, meta.decode_pages, meta.decode_lens, self.page_size,
                    q.shape[-1] ** -0.5,
                )
            # A narrow cache, widened in the kernel: K's scale goes into the query's.
            return self.kernels.decode_attention(
                q, k_cache, v_cache, meta.decode_pages, meta.decode_lens, self.page_size,
                q.shape[-1] ** -0.5 * k_pages[1], v_pages[1],
            )
        batch = q.shape[0]
        kd = self._read(k_pages, meta.decode_pages, head_shape).view(batch, -1, *head_shape)
        vd = self._read(v_pages, meta.decode_pages, head_shape).view(batch, -1, *head_shape)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=meta.decode_mask,
            enable_gqa=True,
        )
        return o.squeeze(2)

    # ---------------------------------------------------------------- special layers

    def _attend_special(self, spec: LayerAttention, q, k, v, meta: TorchAttentionMetadata,
                        k_pages, v_pages, sinks) -> torch.Tensor:
        out = torch.empty_like(q)
        head_shape = k.shape[1:]
        for p in meta.prefills:
            n = p.rows.stop - p.rows.start
            end = p.start + n
            if p.context_pages is None:
                kh, vh = k[p.rows], v[p.rows]
            else:
                kh = self._read(k_pages, p.context_pages, head_shape)[:end]
                vh = self._read(v_pages, p.context_pages, head_shape)[:end]
            mask = self._mask(meta, ("prefill", p.rows.start), spec,
                              torch.arange(p.start, end, device=q.device), end)
            o = special_attention(q[p.rows].transpose(0, 1).unsqueeze(0),
                                  kh.transpose(0, 1).unsqueeze(0),
                                  vh.transpose(0, 1).unsqueeze(0), mask, spec, sinks)
            out[p.rows] = o.squeeze(0).transpose(0, 1)
        if meta.decode_rows is not None:
            table = meta.decode_table
            batch, keys = table.shape[0], table.shape[1] * self.page_size
            kd = self._read(k_pages, table.reshape(-1), head_shape).view(batch, keys,
                                                                            *head_shape)
            vd = self._read(v_pages, table.reshape(-1), head_shape).view(batch, keys,
                                                                            *head_shape)
            mask = self._mask(meta, ("decode",), spec, meta.decode_context - 1, keys)
            o = special_attention(q[meta.decode_rows].unsqueeze(2), kd.transpose(1, 2),
                                  vd.transpose(1, 2), mask[:, None, None, :], spec, sinks)
            out[meta.decode_rows] = o.squeeze(2)
        return out

    @staticmethod
    def _mask(meta: TorchAttentionMetadata, key, spec: LayerAttention, query_pos: torch.Tensor,
              num_keys: int) -> torch.Tensor:
        """[queries, keys], True where a query (at query_pos) may see a key (at
        0..num_keys-1): causal, within the window and within the query's own chunk (Llama
        4's chunked local attention); built once per step per window and chunk."""
        window, chunk = spec.window, spec.chunk
        key = (*key, window, chunk)
        mask = meta.masks.get(key)
        if mask is None:
            key_pos = torch.arange(num_keys, device=query_pos.device).unsqueeze(0)
            mask = key_pos <= query_pos.unsqueeze(1)
            if window is not None:
                mask &= key_pos > query_pos.unsqueeze(1) - window
            if chunk is not None:
                mask &= key_pos >= (query_pos.unsqueeze(1) // chunk) * chunk
            meta.masks[key] = mask
        return mask


def special_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      spec: LayerAttention, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, n, D], k/v [B, KV, m, D], mask broadcastable to [B, H, n, m] -> [B, H, n, D].
    Soft-capping and sinks need the scores themselves (transformers' eager attention);
    otherwise SDPA with the mask and scale."""
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    if spec.softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # one more logit per head that takes probability but contributes no value
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
        scores = scores - scores.max(dim=-1, keepdim=True).values
        probs = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1]
    return torch.matmul(probs, v)
