"""A CPU stand-in for the `flashinfer` module: its paged attention wrappers compute in torch
exactly as FlashInfer documents them (paged NHD cache, CSR page table, causal mask aligned
to the end of the context), and every call the engine makes into it (constructors, plan,
run, RMSNorm, RoPE, SiLU-and-mul, sampling) is recorded with its exact arguments, so a test
can bind them against the pinned FlashInfer's real signatures
(tests/unit/test_flashinfer_api.py) and check what the backend asked for
(use_tensor_cores, the plan's keywords).

`install(monkeypatch)` puts it in sys.modules as `flashinfer` and `flashinfer.sampling`.
"""

from __future__ import annotations

import sys
import types

import msgspec
import torch
import torch.nn.functional as F

VERSION = "0.6.14"  # what it stands in for: the pin in pyproject.toml's `cuda` extra


class Call(msgspec.Struct):
    """One call into flashinfer: `target` names it as the real module spells it
    ("BatchDecodeWithPagedKVCacheWrapper.plan", "rmsnorm", "sampling.sampling_from_probs");
    args exclude a method's self."""

    target: str
    args: tuple
    kwargs: dict


def _paged_context(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """[length, kv_heads, head_dim] of one sequence from an NHD cache [P, page, H, D]."""
    return cache[pages.long()].flatten(0, 1)[:length]


def _attend(q, k, v, causal: bool) -> torch.Tensor:
    """q [n, H, D] over k, v [L, KVH, D]; causal aligned to the end of the context."""
    n, length = q.shape[0], k.shape[0]
    mask = None
    if causal:
        mask = torch.arange(length)[None, :] <= (torch.arange(n) + length - n)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, enable_gqa=True,
    )
    return o.transpose(0, 1).to(q.dtype)


class StandIn(types.ModuleType):
    """The module object: the wrapper classes and functions, and `calls`, in call order."""

    def __init__(self, version: str = VERSION) -> None:
        super().__init__("flashinfer")
        self.__version__ = version
        self.calls: list[Call] = []
        calls = self.calls

        def record(target: str, args: tuple, kwargs: dict) -> None:
            calls.append(Call(target, args, kwargs))

        class Wrapper:
            """A paged wrapper's documented behaviour, in torch."""

            kind = ""

            def __init__(self, workspace, layout="NHD", *args, **kwargs):
                record(f"{self.kind}.__init__", (workspace, layout, *args), kwargs)
                assert layout == "NHD" and not args
                self.use_tensor_cores = kwargs.get("use_tensor_cores", False)
                lengths = kwargs.get("paged_kv_last_page_len_buffer")
                self.fixed_batch = len(lengths) if kwargs.get("use_cuda_graph") else None
                self.plan_kwargs: dict = {}

            def _set(self, qo_indptr, indptr, indices, last_page_len, page_size):
                for t in (qo_indptr, indptr, indices, last_page_len):
                    assert t.dtype == torch.int32
                if self.fixed_batch is not None:
                    assert len(last_page_len) == self.fixed_batch
                self.qo_indptr, self.indptr, self.indices = qo_indptr, indptr, indices
                self.last, self.page_size = last_page_len, page_size

            def run(self, q, kv_cache, *args, **kwargs):
                record(f"{self.kind}.run", (q, kv_cache, *args), kwargs)
                k_cache, v_cache = kv_cache
                out = torch.empty_like(q)
                for i in range(len(self.last)):
                    pages = self.indices[self.indptr[i] : self.indptr[i + 1]]
                    length = (len(pages) - 1) * self.page_size + int(self.last[i])
                    rows = slice(int(self.qo_indptr[i]), int(self.qo_indptr[i + 1]))
                    out[rows] = _attend(q[rows], _paged_context(k_cache, pages, length),
                                        _paged_context(v_cache, pages, length), self.causal)
                return out

        class Prefill(Wrapper):
            kind = "BatchPrefillWithPagedKVCacheWrapper"

            def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads,
                     num_kv_heads, head_dim, page_size, *args, **kwargs):
                record(f"{self.kind}.plan", (qo_indptr, indptr, indices, last_page_len,
                                             num_qo_heads, num_kv_heads, head_dim, page_size,
                                             *args), kwargs)
                self.plan_kwargs = kwargs
                self.causal = kwargs.get("causal", False)
                self._set(qo_indptr, indptr, indices, last_page_len, page_size)

        class Decode(Wrapper):
            kind = "BatchDecodeWithPagedKVCacheWrapper"

            def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                     head_dim, page_size, *args, **kwargs):
                record(f"{self.kind}.plan", (indptr, indices, last_page_len, num_qo_heads,
                                             num_kv_heads, head_dim, page_size, *args), kwargs)
                self.plan_kwargs = kwargs
                self.causal = False
                qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
                self._set(qo, indptr, indices, last_page_len, page_size)

        def recorded(target: str, compute):
            def call(*args, **kwargs):
                record(target, args, kwargs)
                return compute(*args, **kwargs)

            return call

        def rmsnorm(x, weight, eps=1e-6, **_):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
                    * weight.float()).to(x.dtype)

        def silu_and_mul(x, **_):
            half = x.shape[-1] // 2
            return F.silu(x[..., :half]) * x[..., half:]

        self.BatchPrefillWithPagedKVCacheWrapper = Prefill
        self.BatchDecodeWithPagedKVCacheWrapper = Decode
        self.rmsnorm = recorded("rmsnorm", rmsnorm)
        self.silu_and_mul = recorded("silu_and_mul", silu_and_mul)
        # Only the call is checked here; the rotation itself is tests/gpu's business.
        self.apply_rope_with_cos_sin_cache = recorded(
            "apply_rope_with_cos_sin_cache", lambda positions, q, k, *a, **kw: (q, k))
        self.sampling = types.ModuleType("flashinfer.sampling")
        self.sampling.sampling_from_probs = recorded(
            "sampling.sampling_from_probs", lambda probs, *a, **kw: probs.argmax(-1))
        self.sampling.top_k_top_p_sampling_from_probs = recorded(
            "sampling.top_k_top_p_sampling_from_probs",
            lambda probs, *a, **kw: probs.argmax(-1))


def install(monkeypatch, version: str = VERSION) -> StandIn:
    """The stand-in as `flashinfer` (and `flashinfer.sampling`) for one test."""
    module = StandIn(version)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", module.sampling)
    return module
