"""Attention over the paged KV cache in plain torch: the CPU path and the reference.

Cache layout: per layer, one K and one V tensor of shape [num_pages * page_size, kv_heads,
head_dim], addressed by slot = page * page_size + offset. Decodes (one new token each) are
attended in one padded batch; each prefill chunk is attended on its own, because padding a
long chunk to the batch would multiply the work.
"""

from __future__ import annotations

import msgspec
import torch
import torch.nn.functional as F

from engine.scheduler import ScheduledChunk


class PrefillSlice(msgspec.Struct):
    rows: slice  # this chunk's rows in the flattened batch
    start: int  # tokens already in the cache before this chunk
    context_slots: torch.Tensor | None  # slots of the whole context; None when start == 0
    causal_mask: torch.Tensor | None  # [n, start + n] bool; None when start == 0


class TorchAttentionMetadata(msgspec.Struct):
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    decode_rows: torch.Tensor | None  # [B] rows of single-token chunks
    decode_slots: torch.Tensor | None  # [B, L] context slots, padded with slot 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is real
    prefills: list[PrefillSlice]


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
    ) -> None:
        self.page_size = page_size
        self.device = device
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    # ---------------------------------------------------------------- metadata

    def _slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.long)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def prepare(self, chunks: list[ScheduledChunk]) -> TorchAttentionMetadata:
        slot_parts, prefills = [], []
        decode_rows, decode_contexts = [], []
        row = 0
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            slot_parts.append(self._slots(chunk.seq.pages, chunk.start, end))
            if chunk.num_tokens == 1 and chunk.start > 0:
                decode_rows.append(row)
                decode_contexts.append(self._slots(chunk.seq.pages, 0, end))
            else:
                prefills.append(self._prefill_slice(chunk, row))
            row += chunk.num_tokens
        meta = TorchAttentionMetadata(
            slot_mapping=torch.cat(slot_parts).to(self.device),
            decode_rows=None,
            decode_slots=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decode_rows:
            self._add_decode_batch(meta, decode_rows, decode_contexts)
        return meta

    def _prefill_slice(self, chunk: ScheduledChunk, row: int) -> PrefillSlice:
        rows = slice(row, row + chunk.num_tokens)
        if chunk.start == 0:
            return PrefillSlice(rows, 0, None, None)
        end = chunk.start + chunk.num_tokens
        query_pos = torch.arange(chunk.start, end).unsqueeze(1)
        key_pos = torch.arange(end).unsqueeze(0)
        return PrefillSlice(
            rows,
            chunk.start,
            self._slots(chunk.seq.pages, 0, end).to(self.device),
            (key_pos <= query_pos).to(self.device),
        )

    def _add_decode_batch(
        self, meta: TorchAttentionMetadata, rows: list[int], contexts: list[torch.Tensor]
    ) -> None:
        lengths = torch.tensor([len(c) for c in contexts])
        width = int(lengths.max())
        slots = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, ctx in enumerate(contexts):
            slots[i, : len(ctx)] = ctx
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        meta.decode_rows = torch.tensor(rows, device=self.device)
        meta.decode_slots = slots.to(self.device)
        meta.decode_mask = mask[:, None, None, :].to(self.device)

    # ---------------------------------------------------------------- compute

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for p in meta.prefills:
            out[p.rows] = self._attend_prefill(q[p.rows], k[p.rows], v[p.rows], p, k_cache, v_cache)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._attend_decodes(q, meta, k_cache, v_cache)
        return out

    @staticmethod
    def _attend_prefill(q, k, v, p: PrefillSlice, k_cache, v_cache) -> torch.Tensor:
        # [n, H, D] -> [1, H, n, D]
        qh = q.transpose(0, 1).unsqueeze(0)
        if p.context_slots is None:
            kh = k.transpose(0, 1).unsqueeze(0)
            vh = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:
            kh = k_cache[p.context_slots].transpose(0, 1).unsqueeze(0)
            vh = v_cache[p.context_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=p.causal_mask, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    @staticmethod
    def _attend_decodes(q, meta: TorchAttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        qd = q[meta.decode_rows].unsqueeze(2)  # [B, H, 1, D]
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, enable_gqa=True)
        return o.squeeze(2)
