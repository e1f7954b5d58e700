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

from engine.layers.cpu_ops import (
    ANY_KIND_LAYOUT,
    BLOCKS_ONLY_MAX_ROWS_BF16,
    QUANTIZED_MAX_ROWS_FLOAT32,
    CpuKernelOps,
)
from engine.layers.gguf_weights import BLOCK_KINDS
from engine.models.registry import load_model_config, load_quantized_weights, load_weights
from tests.unit.engine_builders import drain, request
from tests.unit.kquant_builders import (
    LlamaShape,
    MoeShape,
    engine_core,
    random_blocks,
    reference,
    write_moe_kquant,
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
        pytest.skip("this build has no AVX512-BF16 path: bfloat16 models use the dense path")
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
    """(blocks, reference weights) of any kind: k-quants from random bytes, Q4_1, Q8_0 and
    MXFP4 (gpt-oss's experts) from gguf-py's quantizer."""
    if name in KQUANTS:
        blocks = random_blocks(name, rows, k, seed)
    else:
        floats = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
        blocks = gguf.quants.quantize(floats, gguf.GGMLQuantizationType[name])
    return torch.from_numpy(blocks), reference(blocks, name)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "MXFP4", *KQUANTS])
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
    for kind in (-1, 6):
        with pytest.raises(RuntimeError, match="kind must be"):
            compiled.pack_blocks(blocks, kind)
    with pytest.raises(RuntimeError, match="blocks must be"):  # not whole Q6_K blocks
        compiled.pack_blocks(blocks, BLOCK_KINDS["Q6_K"])
    for name, as_name in (("Q6_K", "Q4_K"), ("Q4_K", "Q8_0"), ("Q8_0", "Q4_1")):
        with pytest.raises(RuntimeError, match="only kinds 3 and 4 take every kind"):
            compiled.pack_blocks(_blocks_of(name, 4, 512, 1)[0], BLOCK_KINDS[name],
                                 BLOCK_KINDS[as_name])
    with pytest.raises(RuntimeError, match="kind must be"):
        compiled.pack_blocks(blocks, BLOCK_KINDS["Q4_K"], 6)
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


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "MXFP4", *KQUANTS])
def test_dequantized_blocks_are_the_reference_float32(compiled, name):
    """dequantize_blocks (an expert's weights for one big F.linear) gives gguf-py's float32
    weights exactly, from the kind's own layout and from Q6_K's."""
    out, k = SHAPES[2]
    blocks, want = _blocks_of(name, out, k, seed=5)
    for as_kind in (BLOCK_KINDS[name], ANY_KIND_LAYOUT):
        packed = compiled.pack_blocks(blocks, BLOCK_KINDS[name], as_kind)
        assert torch.equal(compiled.dequantize_blocks(packed, as_kind), want)
    with pytest.raises(RuntimeError, match="pack_blocks"):  # not whole packed blocks
        compiled.dequantize_blocks(packed[:, :-1].contiguous(), ANY_KIND_LAYOUT)
    with pytest.raises(RuntimeError, match="kind must be"):
        compiled.dequantize_blocks(packed, 6)


# ------------------------------------------ a tiny Q4_K_M-style MoE: experts as blocks only

MOE = MoeShape()  # 2 layers of 4 experts (top-2), hidden 256


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kquant-moe") / "tiny-moe-q4_k_m.gguf")
    write_moe_kquant(path, MOE, experts="Q4_K", down="Q6_K")
    return path


def _held_bytes(root) -> int:
    """Bytes of every tensor reachable from `root` (a model: its layers, experts and ops),
    each storage once; meta tensors hold none."""
    seen, storages, todo = set(), {}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_mkldnn:  # a oneDNN-prepacked weight (bfloat16): no storage to share
                storages[("mkldnn", id(obj))] = obj.numel() * obj.element_size()
            elif not obj.is_meta:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif hasattr(obj, "__struct_fields__"):
            todo.extend(getattr(obj, f) for f in obj.__struct_fields__)
        elif type(obj).__module__.startswith("engine."):
            todo.extend(vars(obj).values())
    return sum(storages.values())


def _experts(model) -> list[torch.Tensor]:
    return [w for layer in model.layers if layer.moe is not None
            for w in layer.moe.gate_up.weights + layer.moe.down.weights]


def test_moe_experts_load_as_their_blocks_alone(compiled, moe_file):
    """Loaded as build_engine loads it, no expert is dequantized: each expert's weight is a
    meta tensor (no bytes) whose blocks the ops hold, and the model holds what the blocks
    take (6 bits a Q4_K weight, 11 a Q6_K one, once repacked) where the dequantized load
    held a float32 copy of every expert besides."""
    core, ops = engine_core(moe_file, compiled)
    model = core.runner.model
    experts = _experts(model)
    assert len(experts) == 2 * MOE.experts * MOE.layers
    assert all(w.is_meta and ops.holds_blocks(w) for w in experts)
    weights_each = MOE.hidden * MOE.expert_ffn  # per expert and projection
    packed = MOE.layers * MOE.experts * weights_each * (2 * 24 + 44) // 32  # gate, up; down
    assert sum(ops._quantized[id(w)].blocks.nbytes for w in experts) == packed
    dense_experts = MOE.layers * MOE.experts * 3 * weights_each * 4  # float32
    before, before_ops = engine_core(moe_file, compiled, blocks_only=False)
    assert not any(w.is_meta for w in _experts(before.runner.model))
    assert _held_bytes(before.runner.model) - _held_bytes(model) >= dense_experts


class _Counted:
    """The kernels module, counting dequantize_blocks calls (the many-row path)."""

    def __init__(self, kernels) -> None:
        self.kernels, self.dequantized = kernels, 0

    def __getattr__(self, name: str):
        return getattr(self.kernels, name)

    def dequantize_blocks(self, packed, kind):
        self.dequantized += 1
        return self.kernels.dequantize_blocks(packed, kind)


def test_moe_experts_as_blocks_give_the_dequantized_models_tokens(compiled, moe_file):
    """Prefill steps of up to 64 tokens (so 32 rows an expert on average: the dequantize-
    per-call path) and decode steps (the block kernel) over experts held as blocks alone
    give the greedy tokens of the dequantized model on plain torch."""
    prompts = [list(range(3, 43)), [9, 8, 7] * 9, list(range(100, 126)), [5] * 30]

    def greedy(kernels):
        core, _ = engine_core(moe_file, kernels, budget=64)
        for i, prompt in enumerate(prompts):
            core.add(request(f"r{i}", prompt, max_tokens=8))
        results = drain(core)
        return [results[f"r{i}"].tokens for i in range(len(prompts))]

    counted = _Counted(compiled)
    got = greedy(counted)
    assert counted.dequantized > 0  # prefill took the dense path for some experts
    assert got == greedy(None)
    assert len({tuple(t) for t in got}) == len(prompts)  # not one degenerate answer


def test_moe_experts_as_blocks_are_batch_invariant(compiled, moe_file):
    """--batch-invariant: the block kernel at every row count, so a token's MoE output has
    the same bits alone and among 40 rows (where the other mode dequantizes an expert)."""
    core, ops = engine_core(moe_file, compiled, batch_invariant=True)
    moe = core.runner.model.layers[0].moe
    x = torch.randn(40, MOE.hidden, generator=torch.Generator().manual_seed(1))
    together = moe(x, ops)
    for row in (0, 17, 39):
        assert torch.equal(moe(x[row : row + 1], ops), together[row : row + 1]), row


def test_moe_experts_as_blocks_in_bfloat16(compiled, moe_file):
    """A bfloat16 model (where the kernels have bf16 dot products): an expert's rows go
    through the block kernel up to BLOCKS_ONLY_MAX_ROWS_BF16, and past it through F.linear
    over the expert dequantized and rounded to bfloat16 as a dense load rounds it (the
    same bits as the dense model's matmul)."""
    if not compiled.bf16_quantized:
        pytest.skip("this build has no AVX512-BF16 path: a bfloat16 model's experts load "
                    "dequantized")
    core, ops = engine_core(moe_file, compiled, torch.bfloat16)
    weight = core.runner.model.layers[1].moe.down.weights[2]
    assert weight.is_meta and weight.dtype == torch.bfloat16
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    dense = load_weights(moe_file, load_model_config(moe_file), torch.float32)[name]
    many = torch.randn(BLOCKS_ONLY_MAX_ROWS_BF16 + 1, MOE.expert_ffn).bfloat16()
    assert torch.equal(ops.linear(many, weight), F.linear(many, dense.bfloat16()))
    few, blocks = many[:BLOCKS_ONLY_MAX_ROWS_BF16], ops._quantized[id(weight)]
    assert torch.equal(ops.linear(few, weight),
                       compiled.quantized_linear(few, blocks.blocks, blocks.kind))


def test_experts_as_blocks_without_the_ops_to_hold_them_are_refused(moe_file):
    """Experts loaded as blocks alone under ops that hold no blocks (plain torch) would fail
    at their first matmul: the model refuses to build, naming the layer."""
    from engine.models.registry import build_model

    config = load_model_config(moe_file)
    weights = load_weights(moe_file, config, torch.float32, experts_as_blocks=torch.float32)
    with pytest.raises(ValueError, match="layer 0's experts were loaded as GGUF blocks"):
        build_model(config, weights, 64, torch.float32, torch.device("cpu"))
