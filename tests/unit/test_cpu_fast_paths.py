"""The CPU step's fast paths give exactly the numbers of the plain code they replace: the
one-op RMSNorm, RoPE over q and k at once with per-step tables, and oneDNN-prepacked bf16
linear weights."""

import pytest
import torch
import torch.nn.functional as F

from engine.layers.rotary import RotaryEmbedding
from engine.layers.torch_ops import PACKED_MAX_ROWS, TorchOps, can_prepack, rms_norm
from tests.unit.engine_builders import CONFIG


def _transformers_rms_norm(x, weight, eps):
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rms_norm_equals_the_transformers_formula(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    assert torch.equal(rms_norm(x, weight, 1e-5), _transformers_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_q_and_k_together_equals_one_by_one(dtype):
    rope = RotaryEmbedding(CONFIG, 256, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(7, CONFIG.num_heads, CONFIG.head_dim, generator=gen).to(dtype)
    k = torch.randn(7, CONFIG.num_kv_heads, CONFIG.head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 2, 40, 41, 200, 3])
    ops = TorchOps()
    for tables in (None, ops.rope_tables(rope, positions)):
        q_out, k_out = ops.rope(rope, q, k, positions, tables)
        assert torch.equal(q_out, rope.apply(q, positions))
        assert torch.equal(k_out, rope.apply(k, positions))


needs_prepack = pytest.mark.skipif(
    not can_prepack(torch.empty(2, 2, dtype=torch.bfloat16)),
    reason="no native bf16 oneDNN matmul on this CPU",
)


@needs_prepack
@pytest.mark.parametrize("rows", [1, 3, 16, 64, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_linear_equals_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(960, 576, generator=gen) / 24).to(torch.bfloat16)
    bias = torch.randn(960, generator=gen).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 576, generator=gen).to(torch.bfloat16)
    ops = TorchOps()
    ops.prepack(weight)
    assert id(weight) in ops._packed
    assert torch.equal(ops.linear(x, weight, bias), F.linear(x, weight, bias))


def test_float32_weights_are_not_prepacked():
    ops = TorchOps()
    weight = torch.randn(8, 4)
    ops.prepack(weight)
    assert not ops._packed
    x = torch.randn(2, 4)
    assert torch.equal(ops.linear(x, weight), F.linear(x, weight))
