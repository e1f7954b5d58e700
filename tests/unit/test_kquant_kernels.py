"""The CPU kernels' linear over GGUF k-quant blocks (Q4_K, Q5_K, Q6_K: most GGUF files on the
Hub), against gguf-py's reference dequantizer: every weight exact in float32 (through the
packed layout, on every path of both builds), the product with x close to the float64 one,
the AVX2 build's sums the AVX-512 build's bits, and a tiny Q4_K_M-style model through the
engine giving the dequantized model's greedy tokens.
(the blocks: tests/unit/kquant_builders.py)."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.models.config import load_model_config
from engine.models.ops import ANY_KIND_LAYOUT, QUANTIZED_MAX_ROWS_FLOAT32, CpuKernelOps
from engine.models.weights import BLOCK_KINDS, load_quantized_weights
from tests.unit.engine_builders import drain, request
from tests.unit.kquant_builders import (
    LlamaShape,
    engine_core,
    random_blocks,
    reference,
    write_q4_k_m,
)
from tests.unit.test_cpu_kernels import _both_builds

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: threads only add waiting

KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]


# Shapes: one super-block per row (K = 256, the least a k-quant takes); K a multiple of
# 256 but not of 512; a wider one. Outputs not a multiple of the 6-wide column tile.
SHAPES = [(70, 256), (33, 768), (13, 2560)]


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_packed_weight_is_the_reference_float32(compiled, name, shape):
    """x = rows of the identity picks the weights out one by one (w * 1 plus zeros is w):
    the kernel reads exactly gguf-py's float32 weights, on the register-tile path (up to 4
    rows) and the unpacked one (more), in every sub-block of every super-block."""
    out, k = shape
    blocks = random_blocks(name, out, k, seed=k)
    want = reference(blocks, name)
    packed = compiled.pack_blocks(torch.from_numpy(blocks), BLOCK_KINDS[name])
    eye = torch.eye(k)
    for rows in (slice(0, 3), slice(3, 7), slice(0, k)):
        got = compiled.quantized_linear(eye[rows].contiguous(), packed, BLOCK_KINDS[name])
        assert torch.equal(got, want.T[rows]), rows


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("rows", [1, 4, 9, 65])
def test_quantized_linear_float32_is_x_times_the_reference(compiled, name, rows):
    out, k = SHAPES[1]
    blocks = random_blocks(name, out, k, seed=rows)
    weight = reference(blocks, name)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = compiled.quantized_linear(x, compiled.pack_blocks(torch.from_numpy(blocks),
                                                            BLOCK_KINDS[name]), BLOCK_KINDS[name])
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", KQUANTS)
@pytest.mark.parametrize("rows", [1, 4, 21])
def test_quantized_linear_bfloat16_uses_the_dense_bfloat16_weights(compiled, name, rows):
    """As for Q4_1/Q8_0 (test_cpu_kernels.py): each weight rounded to the bfloat16 a
    bfloat16 model holds; oneDNN's matmul over those, but for a rare last-bit rounding."""
    if not compiled.bf16_quantized:
        pytest.skip("no AVX512-BF16 here: bfloat16 models use the dense path")
    out, k = SHAPES[2]
    blocks = random_blocks(name, out * 8, k, seed=rows)
    weight = reference(blocks, name).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = compiled.quantized_linear(x, compiled.pack_blocks(torch.from_numpy(blocks),
                                                            BLOCK_KINDS[name]), BLOCK_KINDS[name])
    want = F.linear(x, weight)
    assert (got == want).float().mean() > 0.99
    torch.testing.assert_close(got, want, atol=1e-5, rtol=8e-3)  # one bfloat16 step apart


def _q4_1_q8_0_blocks(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random Q4_1/Q8_0 blocks whose fp16 scales span the finite range: subnormal, tiny,
    negative and up to about 2 (never inf or NaN: the exponent's top bit clear)."""
    qtype = gguf.GGMLQuantizationType[name]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, k // 32, block_bytes),
                                                dtype=np.uint8)
    scale_bytes = (1, 3) if name == "Q4_1" else (1,)  # the high byte of d (and of m)
    for at in scale_bytes:
        raw[..., at] &= 0xBF
    raw[:, 0, scale_bytes[0]] &= 0x83  # some subnormal d
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_q4_1_and_q8_0_pack_into_the_gguf_bytes_with_the_exact_weights(compiled, name):
    """A decode step streams no more bytes than the GGUF holds (llama.cpp's own read): Q4_1
    and Q8_0 keep their fp16 scales (20 and 34 bytes a block), and the kernel widens them
    exactly: every weight is gguf-py's float32, on the register-tile and unpacked paths."""
    out, k = 37, 320
    blocks = _q4_1_q8_0_blocks(name, out, k, seed=11)
    want = reference(blocks, name)
    assert torch.isfinite(want).all() and (want != 0).any()
    packed = compiled.pack_blocks(torch.from_numpy(blocks), BLOCK_KINDS[name])
    assert packed.shape == blocks.shape  # bytes per row: the GGUF's
    eye = torch.eye(k)
    for rows in (slice(0, 3), slice(3, 7), slice(0, k)):
        got = compiled.quantized_linear(eye[rows].contiguous(), packed, BLOCK_KINDS[name])
        assert torch.equal(got, want.T[rows]), rows


@pytest.mark.parametrize("name", KQUANTS)
def test_the_avx2_linear_sums_as_the_avx512_one(name):
    """The same exact weights and the same summation order: the same float32 bits on an
    AVX2-only machine and an AVX-512 one, at decode row counts and past the unpacking cut."""
    native, avx2 = _both_builds()
    out, k = SHAPES[1]
    blocks = torch.from_numpy(random_blocks(name, out, k, seed=5))
    kind = BLOCK_KINDS[name]
    packs = [m.pack_blocks(blocks, kind) for m in (native, avx2)]
    assert torch.equal(packs[0], packs[1])
    for rows in (1, 3, 6, 70):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(native.quantized_linear(x, packs[0], kind),
                           avx2.quantized_linear(x, packs[1], kind))


def _blocks_of(name: str, rows: int, k: int, seed: int):
    """(blocks, reference weights) of any kind: k-quants from random bytes, Q4_1 and Q8_0
    from gguf-py's quantizer."""
    if name in KQUANTS:
        blocks = random_blocks(name, rows, k, seed)
    else:
        floats = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
        blocks = gguf.quants.quantize(floats, gguf.GGMLQuantizationType[name])
    return torch.from_numpy(blocks), reference(blocks, name)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", *KQUANTS])
def test_every_kind_packs_into_the_layout_of_q6_k(compiled, name):
    """A fused weight whose parts differ in kind (Q4_K_M's q/k/v) is packed part by part
    into Q6_K's layout, which takes every kind's float32 weights exactly."""
    out, k = SHAPES[1]
    blocks, want = _blocks_of(name, out, k, seed=3)
    packed = compiled.pack_blocks(blocks, BLOCK_KINDS[name], ANY_KIND_LAYOUT)
    eye = torch.eye(k)
    for rows in (slice(0, 2), slice(0, k)):  # register tiles, then unpacked columns
        got = compiled.quantized_linear(eye[rows].contiguous(), packed, ANY_KIND_LAYOUT)
        assert torch.equal(got, want.T[rows]), rows


def test_the_kernels_refuse_what_they_cannot_take(compiled):
    blocks = torch.from_numpy(random_blocks("Q4_K", 4, 512, seed=1))
    for kind in (-1, 5):
        with pytest.raises(RuntimeError, match="kind must be"):
            compiled.pack_blocks(blocks, kind)
    with pytest.raises(RuntimeError, match="blocks must be"):  # not whole Q6_K blocks
        compiled.pack_blocks(blocks, BLOCK_KINDS["Q6_K"])
    for name, as_name in (("Q6_K", "Q4_K"), ("Q4_K", "Q8_0"), ("Q8_0", "Q4_1")):
        with pytest.raises(RuntimeError, match="only kinds 3 and 4 take every kind"):
            compiled.pack_blocks(_blocks_of(name, 4, 512, 1)[0], BLOCK_KINDS[name],
                                 BLOCK_KINDS[as_name])
    with pytest.raises(RuntimeError, match="kind must be"):
        compiled.pack_blocks(blocks, BLOCK_KINDS["Q4_K"], 5)
    packed = compiled.pack_blocks(blocks, BLOCK_KINDS["Q4_K"])
    with pytest.raises(RuntimeError, match="pack_blocks"):  # x as wide as half the blocks
        compiled.quantized_linear(torch.randn(2, 256), packed, BLOCK_KINDS["Q4_K"])
    with pytest.raises(RuntimeError, match="pack_blocks"):  # another kind's layout
        compiled.quantized_linear(torch.randn(2, 512), packed, BLOCK_KINDS["Q6_K"])


# ------------------------------------------------- a tiny Q4_K_M-style model, end to end

SHAPE = LlamaShape()  # 2 layers, hidden 256: one super-block per row of most matrices
# What llama.cpp's Q4_K_M mix gives these tensors: Q4_K, with Q6_K for the output and for
# attn_v / ffn_down in some layers (here layer 1's: its q/k/v fuse mixed kinds).
Q6_K_TENSORS = {"output.weight", "blk.0.ffn_down.weight", "blk.1.attn_v.weight",
                "blk.1.ffn_down.weight"}


def _greedy(path: str, compiled, prompts) -> tuple[list[list[int]], CpuKernelOps | None]:
    """Greedy tokens per prompt from the engine over `path`: with the kernels over the
    file's blocks (compiled), or the plain torch ops over the dequantized weights (None)."""
    core, ops = engine_core(path, compiled)
    for i, prompt in enumerate(prompts):
        core.add(request(f"r{i}", prompt, max_tokens=16))
    results = drain(core)
    return [results[f"r{i}"].tokens for i in range(len(prompts))], ops


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf")
    write_q4_k_m(path, SHAPE, Q6_K_TENSORS)
    return path


def test_a_q4_k_m_file_decodes_through_the_blocks_as_the_dequantized_model(compiled,
                                                                             q4_k_m_file):
    """Every linear is multiplied by the file's blocks at decode (prompts prefill in chunks
    of 8 rows, within the float32 cut of 16, so they do too), layer 1's q/k/v of mixed
    kinds in Q6_K's layout; the greedy tokens are the dequantized model's."""
    assert QUANTIZED_MAX_ROWS_FLOAT32 >= 8
    quantized = load_quantized_weights(q4_k_m_file, load_model_config(q4_k_m_file))
    assert {q.kind for q in quantized.values()} == {BLOCK_KINDS["Q4_K"], BLOCK_KINDS["Q6_K"]}
    prompts = [[1, 5, 9, 200, 3], [7] * 11, list(range(40, 60))]
    want, _ = _greedy(q4_k_m_file, None, prompts)
    got, ops = _greedy(q4_k_m_file, compiled, prompts)
    assert len(ops._quantized) == 4 * SHAPE.layers + 1  # every linear and the LM head
    kinds = sorted(q.kind for q in ops._quantized.values())
    assert kinds.count(BLOCK_KINDS["Q4_K"]) == 5  # layer 0's qkv, o, gate_up; layer 1's o, gate_up
    assert kinds.count(ANY_KIND_LAYOUT) == 4  # the two downs, layer 1's qkv, the head
    assert got == want
    assert len({tuple(t) for t in want}) == len(prompts)  # not one degenerate answer
