"""The quantized linear's int16 path (`quantized_linear(..., int16_x=True)`, cpu_kernels.cpp's
"int16 activations"): x rounded to int16 per group of 4 values (d = max|x| / 32767, round
half to even), then integer dot products with the Q4_1 / Q8_0 weight blocks.

- Exact but for float32 rounding: against the float64 product of the GGUF weights with x
  rounded the same way (computed here, independently of the kernel), within
  (blocks + 8) * 2^-24 of the sum of the terms' magnitudes, d_w * sum |d * q_w * q| and
  |m_w| * sum |d * q| per block (a float32 rounding per block in each accumulator lane,
  d_w * d, d * sum(q) and the final lane adds a few more).
- Close to the float-activation result: x moves by at most half an int16 step (d / 2,
  2^-16 of its group's largest) per value, so the result moves by at most the sum over
  values of d / 2 * |w| (plus the float path's own float32 error).
- Batch invariant (a row's result is the one it gets alone), and the same bits in the AVX2
  and the AVX-512 (VNNI) builds, whose integer sums are exact either way.
- Groups whose largest |x| is under 2^-110 count as zeros (FLUSH), so no input overflows
  the rounding: rows of 1e30, 1e-30 and outliers keep the bound above.
"""

import numpy as np
import pytest
import torch

from engine.layers.gguf_weights import BLOCK_KINDS
from tests.unit.test_cpu_kernels import _both_builds

pytestmark = pytest.mark.usefixtures("one_thread")  # small shapes: threads only add waiting

KINDS = ["Q4_1", "Q8_0"]
# in_features: one block (less than a group of eight), 9 blocks (not a multiple of 256),
# SmolLM2's hidden and MLP widths. Outputs not a multiple of the 6-wide column tile.
SHAPES = [(7, 32), (13, 288), (25, 576), (19, 1536)]
# 1 row, odd counts, the register-tile edge, past one 64-row tile of the driver, and a
# prefill chunk's 256 (the batch-invariant mode takes the kernel at every row count).
ROWS = [1, 3, 4, 17, 64, 65, 256]
U = 2.0**-24
# Groups whose largest |x| is below this count as zeros (their d would be subnormal and
# 32767 / max|x| could overflow): the kernel's one departure from plain rounding.
FLUSH = 2.0**-110


def random_blocks(kind: str, out: int, k: int, seed: int) -> np.ndarray:
    """GGUF Q4_1 (fp16 d, fp16 m, 16 bytes of nibbles) or Q8_0 (fp16 d, 32 int8) blocks with
    scales of the size a checkpoint has; Q8_0 includes -128, the one value |q| > 127."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    d = (rng.uniform(0.5, 2.0, (out, nb, 1)) * 2e-3).astype(np.float16)
    if kind == "Q4_1":
        m = (-rng.uniform(0.5, 2.0, (out, nb, 1)) * 1.6e-2).astype(np.float16)
        q = rng.integers(0, 256, (out, nb, 16), dtype=np.uint8)
        blocks = np.concatenate([d.view(np.uint8), m.view(np.uint8), q], axis=-1)
    else:
        q = rng.integers(-128, 128, (out, nb, 32), dtype=np.int8)
        blocks = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1)
    return np.ascontiguousarray(blocks.reshape(out, -1))


def weight_parts(blocks: np.ndarray, kind: str, k: int):
    """(d, m, q) per block in float64: w[j] = d * q[j] + m, the GGUF formulas."""
    out, nb = blocks.shape[0], k // 32
    blk = blocks.reshape(out, nb, -1)
    d = blk[..., 0:2].copy().view(np.float16).astype(np.float64)
    if kind == "Q4_1":
        m = blk[..., 2:4].copy().view(np.float16).astype(np.float64)
        q = np.concatenate([blk[..., 4:] & 0xF, blk[..., 4:] >> 4], axis=-1)
    else:
        m = np.zeros_like(d)
        q = blk[..., 2:].copy().view(np.int8)
    return [torch.from_numpy(a) for a in (d[..., 0], m[..., 0], q.astype(np.float64))]


def group_of() -> torch.Tensor:
    """Each of a block's 32 values' scale group (the kernel's: the 4 values one int32 lane of
    its integer dot product sums, for both kinds): values 2g, 2g+1, 2g+16, 2g+17."""
    return (torch.arange(32) % 16) // 2


def quantize_rows(x: torch.Tensor):
    """x [rows, k] float32 rounded as the kernel does: per group of 4 values, d = max|x| /
    32767 (float32), q = round-half-even(x * (32767 / max|x|)) in float32 arithmetic, and
    q = 0 where max|x| < FLUSH. Returns d per value's group [rows, blocks, 32] and q."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    group = group_of()
    amax = torch.stack([blocks[..., group == g].abs().amax(-1) for g in range(8)], -1)
    amax = amax[..., group]  # back to one per value
    # A tensor division: `32767 / amax` would be torch's reciprocal times 32767, not the
    # correctly rounded quotient the kernel (and IEEE) takes, and a tie can round the other
    # way by that last bit.
    inv = torch.where(amax >= FLUSH, torch.full_like(amax, 32767) / amax,
                      torch.zeros_like(amax))
    return amax / 32767, torch.round(blocks * inv)


def reference(x: torch.Tensor, blocks: np.ndarray, kind: str):
    """The float64 product of the weights with x rounded to int16, and the bound on the
    kernel's float32 error (module docstring)."""
    k = x.shape[1]
    dw, mw, qw = weight_parts(blocks, kind, k)
    dx, qx = quantize_rows(x)
    xs = dx.double() * qx.double()  # x as rounded: exact in float64
    scaled = dw[None] * torch.einsum("rbj,obj->rob", xs, qw)  # d_w * sum d * q_w * q
    offset = mw[None] * xs.sum(-1)[:, None]  # m_w * s
    # The kernel adds parts of a block's sum in separate lanes, and the two terms of a Q4_1
    # block nearly cancel (m < 0): the bound is on the products' magnitudes.
    size = dw[None] * torch.einsum("rbj,obj->rob", xs.abs(), qw.abs())
    slack = (k // 32 + 8) * U * (size + mw.abs()[None] * xs.abs().sum(-1)[:, None]).sum(-1)
    return (scaled + offset).sum(-1), slack


def float_weights(blocks: np.ndarray, kind: str, k: int) -> torch.Tensor:
    dw, mw, qw = weight_parts(blocks, kind, k)
    return (dw[..., None] * qw + mw[..., None]).reshape(blocks.shape[0], k)


def run(compiled, x, blocks, kind, int16_x=True):
    packed = compiled.pack_blocks(torch.from_numpy(blocks), BLOCK_KINDS[kind])
    return compiled.quantized_linear(x, packed, BLOCK_KINDS[kind], int16_x=int16_x)


def needs_path(compiled):
    if not compiled.int16_dot:
        pytest.skip("this build has no int16 path (no AVX2)")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_int16_path_is_the_rounded_x_product_up_to_float32_sums(compiled, kind, shape):
    needs_path(compiled)
    out, k = shape
    blocks = random_blocks(kind, out, k, seed=k)
    gen = torch.Generator().manual_seed(out)
    x = torch.randn(max(ROWS), k, generator=gen)
    x[0, :32] = 0.0  # an all-zero block: d = 0, no division by zero
    x[1, 5] = 40.0  # an outlier: its group's other values round coarsely, still exactly so
    want, slack = reference(x, blocks, kind)
    for rows in ROWS:
        got = run(compiled, x[:rows].contiguous(), blocks, kind).double()
        err = (got - want[:rows]).abs()
        assert (err <= slack[:rows]).all(), (rows, (err / slack[:rows]).max().item())


@pytest.mark.parametrize("kind", KINDS)
def test_int16_path_takes_extreme_magnitudes(compiled, kind):
    """Rows of zeros, of 1e30 and 1e-30 (d and the products stay normal float32), a row
    whose every group holds one outlier 1e4 times its neighbours, and groups under FLUSH
    (counted as zeros), each within the same bound of the float64 reference."""
    needs_path(compiled)
    out, k = 11, 288
    blocks = random_blocks(kind, out, k, seed=7)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, k, generator=gen)
    x[0] = 0.0
    x[1] *= 1e30
    x[2] *= 1e-30
    x[3].view(-1, 32)[:, 0:16:2] *= 1e4  # value 2g: one outlier in each group g
    x[4, :64] *= 1e-36  # two blocks whose every group is below FLUSH
    x[5] *= 1e-36  # a whole row below FLUSH: nothing at all (not 32767 / max = inf)
    want, slack = reference(x, blocks, kind)
    got = run(compiled, x, blocks, kind).double()
    assert torch.equal(got[0], torch.zeros(out, dtype=torch.float64))
    assert torch.equal(got[5], torch.zeros(out, dtype=torch.float64))
    assert torch.isfinite(got).all()
    assert ((got - want).abs() <= slack).all(), ((got - want).abs() / slack).max().item()
    # Flushed groups add nothing: the row is the row with them zeroed, bit for bit.
    zeroed = x[4:5].clone()
    zeroed[0, :64] = 0.0
    assert torch.equal(run(compiled, x[4:5], blocks, kind), run(compiled, zeroed, blocks, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_int16_path_stays_within_half_a_step_of_the_float_path(compiled, kind):
    needs_path(compiled)
    out, k = 31, 576
    blocks = random_blocks(kind, out, k, seed=1)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    got = run(compiled, x, blocks, kind).double()
    floats = run(compiled, x, blocks, kind, int16_x=False).double()
    w = float_weights(blocks, kind, k)
    exact = x.double() @ w.T
    dx, _ = quantize_rows(x)
    step = (dx.double().reshape(5, -1) / 2) @ w.abs().T  # sum over values of d / 2 * |w|
    assert ((got - exact).abs() <= 1.001 * step + 1e-5).all()
    assert (floats - exact).abs().max() < 1e-5
    # Not the float path: the rounding is there (the test would pass a path that ignored
    # int16_x only if it also met the bound above, which it does; this tells them apart).
    assert not torch.equal(got, floats)


@pytest.mark.parametrize("kind", KINDS)
def test_int16_path_gives_a_row_its_own_result_in_any_batch(compiled, kind):
    needs_path(compiled)
    out, k = 20, 288
    blocks = random_blocks(kind, out, k, seed=3)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([run(compiled, x[i:i + 1], blocks, kind) for i in range(x.shape[0])])
    for rows in (2, 5, 64, 65, 130):
        assert torch.equal(run(compiled, x[:rows], blocks, kind), alone[:rows]), rows


def test_int16_path_takes_bfloat16_rows(compiled):
    """bfloat16 x widens exactly before the rounding: the float32 copy's result, rounded."""
    needs_path(compiled)
    blocks = random_blocks("Q4_1", 9, 576, seed=4)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = run(compiled, x, blocks, "Q4_1")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, run(compiled, x.float(), blocks, "Q4_1").bfloat16())


def test_other_kinds_ignore_int16_x(compiled):
    """Q4_K and the other float32-scale layouts have no int16 path: the float one runs."""
    from tests.unit.kquant_builders import random_blocks as kquant_blocks

    blocks = torch.from_numpy(kquant_blocks("Q4_K", 7, 256, seed=5))
    packed = compiled.pack_blocks(blocks, BLOCK_KINDS["Q4_K"])
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    assert torch.equal(compiled.quantized_linear(x, packed, BLOCK_KINDS["Q4_K"], int16_x=True),
                       compiled.quantized_linear(x, packed, BLOCK_KINDS["Q4_K"]))


@pytest.mark.parametrize("kind", KINDS)
def test_the_avx2_int16_path_gives_the_avx512_bits(kind):
    """Integer sums are exact whether vpmaddwd or VNNI's vpdpwssd take them, and the float32
    steps are the same: both builds give a row the same bits."""
    native, avx2 = _both_builds()
    blocks = random_blocks(kind, 25, 1536, seed=6)
    x = torch.randn(17, 1536, generator=torch.Generator().manual_seed(6))
    assert torch.equal(run(native, x, blocks, kind), run(avx2, x, blocks, kind))


def test_the_engine_takes_the_int16_path_up_to_two_rows_by_default(compiled, monkeypatch):
    """On by default up to 2 rows (INT16_X_MAX_ROWS); SLUICE_CPU_INT16_ROWS=N: float32 rows
    over Q4_1 or Q8_0 blocks up to N rows (0: off); never other kinds, bfloat16 rows or the
    batch-invariant mode."""
    from engine.layers.cpu_ops import INT16_X_MAX_ROWS, CpuKernelOps

    q4_1, q8_0, q4_k = BLOCK_KINDS["Q4_1"], BLOCK_KINDS["Q8_0"], BLOCK_KINDS["Q4_K"]
    one, two = torch.empty(1, 64), torch.empty(2, 64)
    monkeypatch.delenv("SLUICE_CPU_INT16_ROWS", raising=False)
    assert INT16_X_MAX_ROWS == 2
    ops = CpuKernelOps(compiled)
    assert ops.int16_x(one, q4_1) == ops.int16_x(two, q8_0) == compiled.int16_dot
    assert not ops.int16_x(torch.empty(3, 64), q4_1)
    assert not ops.int16_x(one, q4_k)
    assert not ops.int16_x(one.bfloat16(), q4_1)
    assert not CpuKernelOps(compiled, batch_invariant=True).int16_x(one, q4_1)
    monkeypatch.setenv("SLUICE_CPU_INT16_ROWS", "0")
    assert not CpuKernelOps(compiled).int16_x(one, q4_1)
    monkeypatch.setenv("SLUICE_CPU_INT16_ROWS", "16")
    assert CpuKernelOps(compiled).int16_x(torch.empty(16, 64), q4_1) == compiled.int16_dot
    monkeypatch.setenv("SLUICE_CPU_INT16_ROWS", "all")
    with pytest.raises(ValueError, match="SLUICE_CPU_INT16_ROWS"):
        CpuKernelOps(compiled)


def test_int16_rounding_takes_ties_to_even(compiled):
    """One-hot Q8_0 weights (d = 1) pick each rounded value d * q out: with max|x| = 32767
    in a group the step is 1, so 2.5 -> 2, -3.5 -> -4, 1.5 -> 2, -2.5 -> -2, 0.5 -> 0
    (torch.round's). Groups: values {0, 1, 16, 17} and {2, 3, 18, 19}."""
    needs_path(compiled)
    blocks = np.zeros((32, 34), dtype=np.uint8)
    blocks[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    blocks[np.arange(32), 2 + np.arange(32)] = 1
    x = torch.zeros(1, 32)
    where = [0, 1, 16, 17, 2, 3, 18, 19]
    x[0, where] = torch.tensor([2.5, 32767.0, -3.5, 1.5, -32767.0, -2.5, 4.5, 0.5])
    got = run(compiled, x, blocks, "Q8_0")
    assert got[0, where].tolist() == [2.0, 32767.0, -4.0, 2.0, -32767.0, -2.0, 4.0, 0.0]
    rest = torch.ones(32, dtype=torch.bool)
    rest[where] = False
    assert not got[0, rest].any()
