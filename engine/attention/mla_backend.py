"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in torch.

Cache layout: per layer one tensor [num_pages * page_size, 1, latent_width], a row per
token: the normed KV latent (kv_lora_rank) then the rotated shared key part
(qk_rope_head_dim). No per-head K or V is stored, which is the point of MLA: DeepSeek-V3
keeps 576 numbers a token a layer where its 128 heads' K and V would be 40,960. Pages are
the same pages as the plain backend's (same slots, page tables, prefix cache and chunked
prefill), only narrower; the step metadata is the torch backend's own (`prepare`).

The model absorbs the up-projections (engine.models.deepseek): its queries come in already
multiplied into latent space, [T, heads, latent_width], so attention is multi-query
attention over the cached rows, with the first kv_lora_rank numbers of each row as the
value; the output, [T, heads, kv_lora_rank], is projected to each head's value by the model.
Prefill chunks and decodes both take this absorbed form on this path.

No CPU kernels (their decode kernel takes per-head K/V of one width), no batch-invariant
mode, no FlashInfer MLA kernels yet: engine.attention.selector refuses those for MLA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
    zeros_on_first_write,
)


class MlaAttentionBackend(TorchAttentionBackend):
    name = "torch-mla"

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_lora_rank: int,
                 rope_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        # What the inherited `prepare` reads: plain torch, every layer alike.
        self.page_size = page_size
        self.special: list = []
        self.device = device
        self.kernels = None
        self.batch_invariant = False
        self.kv_lora_rank = kv_lora_rank
        width = kv_lora_rank + rope_dim
        shape = (num_pages * page_size, 1, width)
        self.latent_cache = [zeros_on_first_write(shape, dtype, device)
                             for _ in range(num_layers)]
        self._pages = [c.view(num_pages, -1) for c in self.latent_cache]

    def cache_bytes_per_token(self) -> int:
        """Bytes of cache one token takes over all layers."""
        return sum(c[0].numel() * c.element_size() for c in self.latent_cache)

    def decode_kernel_inputs(self, layer: int, meta: TorchAttentionMetadata) -> None:
        return None  # no fused CPU decode layer over latents

    def attend(self, layer, q, k, v, meta, sinks=None):
        raise TypeError("the MLA backend attends latents: call attend_latent")

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor,
                      meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, heads, latent_width] (absorbed), latent: [T, 1, latent_width], the step's
        new rows -> [T, heads, kv_lora_rank]."""
        self.latent_cache[layer].index_copy_(0, meta.slot_mapping, latent)
        pages = self._pages[layer]
        row_shape = latent.shape[1:]
        out = q.new_empty(*q.shape[:2], self.kv_lora_rank)
        for p in meta.prefills:
            if p.context_pages is None:
                keys, mask = latent[p.rows], None
            else:
                end = p.causal_mask.shape[1]
                keys = self._gather(pages, p.context_pages, row_shape)[:end]
                mask = p.causal_mask
            kh = keys.transpose(0, 1).unsqueeze(0)  # [1, 1, m, width]
            o = self._sdpa(q[p.rows].transpose(0, 1).unsqueeze(0), kh, mask, scale)
            out[p.rows] = o.squeeze(0).transpose(0, 1)
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            batch = rows.shape[0]
            keys = self._gather(pages, meta.decode_pages, row_shape).view(batch, -1, *row_shape)
            o = self._sdpa(q[rows].unsqueeze(2), keys.transpose(1, 2), meta.decode_mask, scale)
            out[rows] = o.squeeze(2)
        return out

    def _sdpa(self, q, keys, mask, scale) -> torch.Tensor:
        """q [B, H, n, width], keys [B, 1, m, width]: values are the keys' latent part."""
        values = keys[..., : self.kv_lora_rank]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
