"""MXFP4 kept packed (issue 56): the CPU kernels' linear over MXFP4 blocks (gpt-oss's experts,
GGUF's MXFP4 type) held as the 17-byte blocks themselves, against a float32 reference built
from the format's definition, on both builds; and a tiny random gpt-oss checkpoint with MXFP4
experts whose experts stay packed (the checkpoint's bytes) and give the dequantized model's
greedy tokens and logits."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu_kernels import kernels
from engine.layers.gguf_weights import BLOCK_KINDS
from engine.layers.safetensors_weights import in_mapped_file
from engine.models.gpt_oss import FP4_VALUES, dequantize_mxfp4, mxfp4_gguf_blocks
from engine.models.registry import load_model_config, load_weights
from engine.process.build import build_engine
from tests.tiny_vlm import tiny_vlm_tokenizer
from tests.unit.engine_builders import drain, request
from tests.unit.test_cpu_kernels import _both_builds
from tests.unit.test_kquant_kernels import _Counted, _held_bytes
from tests.unit.test_model_families import (
    CASES,
    _engine_config,
    _rewrite_config,
    _rewrite_tensors,
)
from tests.unit.test_model_reference import TINY, _build_core, _run, make_reference

pytestmark = pytest.mark.usefixtures("one_thread")

KIND = BLOCK_KINDS["MXFP4"]
BLOCK_BYTES = 17  # an E8M0 scale byte and 16 bytes of two e2m1 codes each, per 32 weights


def random_mxfp4(rows: int, k: int, seed: int, scales=(100, 140)) -> np.ndarray:
    """GGUF MXFP4 rows [rows, k / 32 * 17] of random codes; scale bytes drawn from `scales`,
    and the first block of each row given 0, 1 or 2 (2^-128 .. 2^-126: denormal d)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // 32, BLOCK_BYTES), dtype=np.uint8)
    raw[..., 0] = rng.integers(*scales, (rows, k // 32), dtype=np.uint8)
    raw[:, 0, 0] = np.arange(rows) % 3
    return raw.reshape(rows, -1)


def reference(blocks: np.ndarray) -> torch.Tensor:
    """The format's definition in float64: code c (weight j: byte j's low nibble, j + 16:
    its high one) is FP4_VALUES[c] * 2^(e - 127); every such value is a float32."""
    rows = blocks.shape[0]
    b = torch.from_numpy(blocks).reshape(rows, -1, BLOCK_BYTES).long()
    codes = torch.cat([b[..., 1:] & 0xF, b[..., 1:] >> 4], dim=-1)  # weights 0-15, 16-31
    values = torch.tensor(FP4_VALUES, dtype=torch.float64)[codes]
    weights = values * torch.pow(2.0, (b[..., :1] - 127).double())
    return weights.reshape(rows, -1).float()


# Outputs not a multiple of the 6-wide column tile; one block a row, then wider.
SHAPES = [(7, 32), (37, 320), (13, 2880)]


@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp4_is_held_as_its_own_bytes_with_the_exact_weights(compiled, shape):
    """pack_blocks keeps the GGUF block (17 bytes a 32-weight block: 4.25 bits a weight), and
    the kernel reads the reference float32 weights exactly (rows of the identity pick them
    out one by one), on the register-tile path and the unpacked one; gguf-py agrees."""
    out, k = shape
    blocks = random_mxfp4(out, k, seed=k)
    want = reference(blocks)
    assert torch.equal(want, torch.from_numpy(
        gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)))
    assert (want != 0).any()
    packed = compiled.pack_blocks(torch.from_numpy(blocks), KIND)
    assert packed.shape == blocks.shape and torch.equal(packed, torch.from_numpy(blocks))
    eye = torch.eye(k)
    for rows in (slice(0, 3), slice(3, 7), slice(0, k)):
        got = compiled.quantized_linear(eye[rows].contiguous(), packed, KIND)
        assert torch.equal(got, want.T[rows]), rows
    assert torch.equal(compiled.dequantize_blocks(packed, KIND), want)


@pytest.mark.parametrize("rows", [1, 4, 9, 65])
def test_mxfp4_linear_float32_is_x_times_the_reference(compiled, rows):
    out, k = SHAPES[2]
    blocks = random_mxfp4(out, k, seed=rows, scales=(118, 124))
    weight = reference(blocks)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = compiled.quantized_linear(x, compiled.pack_blocks(torch.from_numpy(blocks), KIND), KIND)
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 21])
def test_mxfp4_linear_bfloat16_uses_the_bfloat16_weights(compiled, rows):
    """Every MXFP4 weight is a bfloat16 (2 significant bits): the bf16 dot products multiply
    by exactly the dense bfloat16 model's weights; oneDNN's matmul but for summation order."""
    if not compiled.bf16_quantized:
        pytest.skip("this build has no AVX512-BF16 path: bfloat16 models use the dense path")
    out, k = SHAPES[1]
    blocks = random_mxfp4(out * 8, k, seed=rows, scales=(118, 124))
    weight = reference(blocks)
    assert torch.equal(weight.to(torch.bfloat16).float(), weight)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = compiled.quantized_linear(x, compiled.pack_blocks(torch.from_numpy(blocks), KIND), KIND)
    want = F.linear(x, weight.to(torch.bfloat16))
    assert (got == want).float().mean() > 0.99
    torch.testing.assert_close(got, want, atol=1e-5, rtol=8e-3)


def test_the_avx2_mxfp4_linear_sums_as_the_avx512_one():
    """The same weights (the AVX2 path's two 8-entry lookups give the one 16-entry lookup's
    values) in the same order: the same float32 bits on both builds."""
    native, avx2 = _both_builds()
    blocks = torch.from_numpy(random_mxfp4(*SHAPES[1], seed=4))
    packs = [m.pack_blocks(blocks, KIND) for m in (native, avx2)]
    for rows in (1, 3, 6, 70):
        x = torch.randn(rows, SHAPES[1][1], generator=torch.Generator().manual_seed(rows))
        assert torch.equal(native.quantized_linear(x, packs[0], KIND),
                           avx2.quantized_linear(x, packs[1], KIND))
    assert torch.equal(native.dequantize_blocks(packs[0], KIND),
                       avx2.dequantize_blocks(packs[1], KIND))


def test_checkpoint_blocks_repack_to_gguf_blocks_of_the_same_weights(compiled):
    """gpt-oss's safetensors blocks (byte j: weights 2j, 2j + 1) and scales become GGUF
    blocks of the same bytes count whose weights are the checkpoint's dequantized ones."""
    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (1, 11, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (1, 11, 4), generator=gen, dtype=torch.uint8)
    rows = mxfp4_gguf_blocks(blocks[0], scales[0])
    assert rows.dtype == torch.uint8 and rows.shape == (11, 4 * BLOCK_BYTES)
    assert rows.nbytes == blocks.nbytes + scales.nbytes
    dense = dequantize_mxfp4(blocks, scales)[0].T  # [out, in]
    assert torch.equal(compiled.dequantize_blocks(compiled.pack_blocks(rows, KIND), KIND), dense)


# ------------------------------------------------- a tiny gpt-oss with MXFP4 experts, end to end


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A tiny random gpt-oss folder as published: experts as `*_blocks` / `*_scales`
    (quant_method mxfp4), and transformers' tokens and logits over the same weights
    dequantized by its own converter."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(5)
    packed = {}

    def quantize_experts(model):
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                for name in ("gate_up_proj", "down_proj"):
                    param = getattr(layer.mlp.experts, name)
                    experts, width, rows = param.shape  # dense layout: [E, in, out]
                    blocks = torch.randint(0, 256, (experts, rows, width // 32, 16),
                                           generator=gen, dtype=torch.uint8)
                    scales = torch.randint(122, 125, (experts, rows, width // 32),
                                           generator=gen, dtype=torch.uint8)
                    param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                    packed[f"model.layers.{i}.mlp.experts.{name}"] = (blocks, scales)

    config_cls, model_cls, overrides = CASES["gpt_oss"]
    ref = make_reference(tmp_path_factory.mktemp("gpt-oss-mxfp4"), config_cls, model_cls,
                         {**TINY, **overrides}, seed=8, prepare=quantize_experts)

    def swap_in_blocks(tensors):
        for name, (blocks, scales) in packed.items():
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales

    _rewrite_tensors(ref.path, swap_in_blocks)
    _rewrite_config(ref.path, quantization_config={"quant_method": "mxfp4"})
    checkpoint_bytes = sum(b.nbytes + s.nbytes for b, s in packed.values())
    return ref, checkpoint_bytes


def _experts(model) -> list[torch.Tensor]:
    return [w for layer in model.layers for w in layer.moe.gate_up.weights + layer.moe.down.weights]


def test_mxfp4_experts_are_held_packed(mxfp4_checkpoint):
    """With the kernels every expert is a meta weight whose 17-byte blocks the ops hold:
    exactly the checkpoint's blocks and scales in bytes, where the dequantized model (plain
    torch ops) holds float32 experts, 7.5 times as many."""
    compiled = kernels()
    if compiled is None:
        pytest.skip("no C++ compiler: the engine runs plain torch ops")
    ref, checkpoint_bytes = mxfp4_checkpoint
    config = load_model_config(ref.path)
    assert config.family_options.mxfp4
    # The loader hands the codes over as the file's bytes (mapped), never as floats.
    weights = load_weights(ref.path, config, torch.float32, map_experts_as=torch.float32)
    stored = [t for name, t in weights.items() if name.endswith(("_blocks", "_scales"))]
    assert sum(t.nbytes for t in stored) == checkpoint_bytes
    assert all(t.dtype == torch.uint8 and in_mapped_file(t) for t in stored)
    del weights, stored
    model = _build_core(ref.path, 64, compiled)[0].runner.model
    experts, ops = _experts(model), model.ops
    assert experts and all(w.is_meta and ops.holds_blocks(w) for w in experts)
    held = [ops._quantized[id(w)] for w in experts]
    assert {q.kind for q in held} == {KIND}
    assert sum(q.blocks.nbytes for q in held) == checkpoint_bytes
    dense = _build_core(ref.path, 64)[0].runner.model
    assert not any(w.is_meta for w in _experts(dense))
    dense_experts = sum(w.nbytes for w in _experts(dense))
    assert dense_experts == checkpoint_bytes * 32 * 4 // BLOCK_BYTES
    assert _held_bytes(dense) - _held_bytes(model) >= dense_experts - checkpoint_bytes


@pytest.mark.parametrize("mode", ["together", "single-chunk"])
def test_packed_mxfp4_experts_give_the_dequantized_models_tokens(mxfp4_checkpoint, mode):
    """Decode (the block kernel) and prefill in chunks of 8 rows or one chunk of every prompt
    (experts past BLOCKS_ONLY_MAX_ROWS rows dequantized for the call): the greedy tokens of
    the dequantized model on plain torch and of transformers, logits within 1e-4 of both."""
    compiled = kernels()
    if compiled is None:
        pytest.skip("no C++ compiler: the engine runs plain torch ops")
    ref, _ = mxfp4_checkpoint
    counted = _Counted(compiled)
    tokens, logits, _ = _run(ref.path, ref.prompts, mode, counted)
    assert (counted.dequantized > 0) == (mode == "single-chunk")  # else the kernel alone
    dense_tokens, dense_logits, _ = _run(ref.path, ref.prompts, mode)
    assert tokens == dense_tokens == ref.tokens
    for i in range(len(ref.prompts)):
        torch.testing.assert_close(logits[i], dense_logits[i], atol=1e-4, rtol=0)
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
    assert len({tuple(t) for t in tokens}) == len(tokens)  # not one degenerate answer


def test_served_packed_by_build_engine(mxfp4_checkpoint):
    """`sluice serve DIR`'s engine (default ops: the kernels where they build) holds the
    experts packed and gives transformers' greedy tokens."""
    ref, _ = mxfp4_checkpoint
    tiny_vlm_tokenizer().save_pretrained(ref.path)  # a byte-level one, as llguidance needs
    core = build_engine(_engine_config(ref.path, threads=1))
    model = core.runner.model
    if kernels() is not None:
        assert all(w.is_meta and model.ops.holds_blocks(w) for w in _experts(model))
    for i, prompt in enumerate(ref.prompts):
        core.add(request(f"r{i}", prompt, max_tokens=len(ref.tokens[i]), ignore_eos=True))
    results = drain(core)
    assert [results[f"r{i}"].tokens for i in range(len(ref.prompts))] == ref.tokens
