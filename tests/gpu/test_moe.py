"""The MoE block on CUDA: bfloat16 experts go through one grouped GEMM per projection
(F.grouped_mm over the stacked experts), the same output as the per-expert loop the CPU
serves with, within bfloat16 rounding. Skipped where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)",
                allow_module_level=True)

from engine.layers.config import MoeConfig  # noqa: E402
from engine.layers.torch_ops import TorchOps  # noqa: E402
from engine.models.moe import ExpertLinear, MoeBlock  # noqa: E402


def test_bfloat16_experts_on_cuda_take_the_grouped_gemm():
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        w = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
        return w.to("cuda", torch.bfloat16)

    config = MoeConfig(num_experts=8, top_k=2, intermediate_size=128, norm_topk_prob=True)
    block = MoeBlock(config, rand(8, 256), None,
                     ExpertLinear([rand(256, 256) for _ in range(8)]),
                     ExpertLinear([rand(256, 128) for _ in range(8)]))
    assert block.stacks is not None  # stacked at construction on CUDA
    x, ops = rand(37, 256), TorchOps()
    routed = block.route(x)
    want = block.grouped_experts(x, *routed, ops).float()
    got = block(x, ops).float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
