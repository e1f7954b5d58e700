"""The CPU KV cache's memory becomes resident as it is written, not when it is allocated
(engine.attention.torch_backend.zeros_on_first_write)."""

import torch

from engine.attention.torch_backend import TorchAttentionBackend, zeros_on_first_write

MB = 1 << 20


def _rss() -> int:
    status = open("/proc/self/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def test_a_cache_costs_nothing_until_written_then_reads_zeros():
    before = _rss()
    cache = zeros_on_first_write((256 * MB // 4 // 64, 1, 64), torch.float32, torch.device("cpu"))
    assert _rss() - before < 16 * MB  # torch.zeros would have written all 256 MB
    assert cache.is_contiguous() and cache.dtype == torch.float32
    cache[:1024] = 1.0  # 256 KB written
    assert _rss() - before < 32 * MB
    assert cache[:1024].eq(1).all() and cache[1024:].count_nonzero() == 0
    del cache


def test_every_dtype_and_shape_the_backend_asks_for():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cache = zeros_on_first_write((48, 3, 64), dtype, torch.device("cpu"))
        assert cache.shape == (48, 3, 64) and cache.dtype == dtype
        assert cache.count_nonzero() == 0
    assert zeros_on_first_write((0, 3, 64), torch.float32, torch.device("cpu")).numel() == 0


def test_the_backend_allocates_its_pages_so():
    before = _rss()
    backend = TorchAttentionBackend(num_layers=4, num_pages=4096, page_size=16, num_kv_heads=4,
                                    head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    assert len(backend.k_cache) == 4 and backend.k_cache[0].shape == (4096 * 16, 4, 64)
    assert _rss() - before < 32 * MB  # 4 layers x K and V x 64 MB = 512 MB reserved
