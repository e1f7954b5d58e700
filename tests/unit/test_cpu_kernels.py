"""The compiled CPU kernels (engine/kernels/csrc/cpu_kernels.cpp) against the torch code they
replace: RoPE and the residual add give the same bits; RMSNorm (alone and after the add)
too, but where its float32 sum of squares (taken in another order) moves a normalised
bfloat16 value across a rounding midpoint; SiLU-and-mul the same
bfloat16 values (its exp is a polynomial, so float32 may differ in the last bits); the
paged decode attention the float64 answer over the same context, read through a shuffled
page table; and the block-quantized linear the product with the weights the dense model
holds."""

from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu_kernels import cpu_flags, cpu_runs, kernels_for
from engine.layers.cpu_ops import QUANTIZED_MAX_ROWS_FLOAT32, WIDENED_MAX_ROWS, CpuKernelOps
from engine.layers.gguf_weights import BLOCK_KINDS, QuantizedWeight
from engine.layers.ops import make_ops
from engine.layers.rotary import RotaryEmbedding
from engine.layers.torch_ops import TorchOps, rms_norm
from engine.models.llama import LlamaModel
from engine.models.registry import load_model_config, load_quantized_weights, load_weights
from engine.request.batch import ScheduledChunk
from shared.model_source import default_model_path
from tests.unit.engine_builders import CONFIG, random_weights

DTYPES = [torch.float32, torch.bfloat16]


def test_the_engine_uses_them_on_cpu(compiled):
    assert isinstance(make_ops("torch", torch.device("cpu")), CpuKernelOps)


# Dims: SmolLM2's hidden size and head dim, a multiple of 16 (the vector paths alone), and
# 40 and 100, which leave a tail after the 16-wide sum (and 8 or 16-wide steps).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (5, 576), (64, 576), (300, 576), (7, 4, 32),
                                   (6, 9, 64), (3, 5, 40), (4, 100)])
def test_rms_norm(compiled, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    _assert_same_norm(compiled.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5), x,
                      weight, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (4, 576), (300, 576), (3, 100)])
def test_add_rms_norm_is_the_add_then_the_norm(compiled, dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows)
    h = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    delta = torch.randn(rows, dim, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    normed, summed = CpuKernelOps(compiled).add_rms_norm(h, delta, weight, 1e-5)
    want_normed, want_summed = TorchOps().add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(summed, want_summed)
    _assert_same_norm(normed, want_normed, summed, weight, 1e-5)


# How far (relative) the kernel's float32 normalised value x * scale may be from the exact
# one, and torch's too: a few float32 ulps (2^-24 to 2^-23 each) of the scale, whose sum of
# squares each adds in its own order, and the product's rounding.
NORM_SCALE_RTOL = 2**-19


def _assert_same_norm(got, want, x, weight, eps):
    """What the norm promises against torch. float32: a few ulps. bfloat16: torch's bits,
    except where the exact normalised value x / rms(x) lies within NORM_SCALE_RTOL of a
    midpoint between two bfloat16 values: there the two float32 sums (taken in other orders)
    may round it to either side, and the output is the weight times the other one. (The
    AVX-512 and AVX2 builds sum in one order: they agree bit for bit, tested below.)"""
    if got.dtype != torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    differ = got != want
    if not differ.any():
        return
    x64 = x.double()
    exact = (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps))[differ]
    step = torch.exp2(torch.floor(torch.log2(exact.abs())) - 7)  # bfloat16: 8 bits
    below = torch.floor(exact / step) * step  # the bfloat16 values either side of it
    midpoint = below + step / 2
    near = (exact - midpoint).abs() <= NORM_SCALE_RTOL * exact.abs()
    assert near.all(), f"{int((~near).sum())} of {differ.sum()} differences not at a midpoint"
    w = weight.expand_as(got)[differ]
    either = [w * side.to(torch.bfloat16) for side in (below, below + step)]
    assert ((got[differ] == either[0]) | (got[differ] == either[1])).all()


def test_the_norm_tolerance_lets_only_a_midpoint_round_either_way():
    """_assert_same_norm itself (the kernels rarely hit a midpoint in the cases above): a
    row whose first value normalises to exactly 1 + 2^-8, halfway between the bfloat16
    values 1 and 1 + 2^-7, may give either; its second value, far from a midpoint, may not
    move one step."""
    first = 1 + 2**-8
    x = torch.tensor([[first] + [((4 - first**2) / 3) ** 0.5] * 3], dtype=torch.float64)
    weight = torch.ones(4, dtype=torch.bfloat16)
    want = rms_norm(x.float(), weight.float(), 0.0).bfloat16()
    assert want[0, 0] == 1  # torch: the midpoint to even
    other_side = want.clone()
    other_side[0, 0] = 1 + 2**-7
    _assert_same_norm(other_side, want, x, weight, 0.0)
    moved = want.clone()
    moved[0, 1] = moved[0, 1] * (1 + 2**-7)
    with pytest.raises(AssertionError, match="not at a midpoint"):
        _assert_same_norm(moved, want, x, weight, 0.0)


def test_rms_norm_of_per_head_views(compiled):
    """Qwen3's q/k norm: heads of a fused qkv row, a view whose rows are not contiguous."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 3 * 4 * 32, generator=gen).to(torch.bfloat16)
    q = qkv[:, : 4 * 32].view(6, 4, 32)
    weight = (1 + 0.1 * torch.randn(32, generator=gen)).to(torch.bfloat16)
    assert torch.equal(compiled.rms_norm(q, weight, 1e-6), rms_norm(q, weight, 1e-6))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: torch.equal alone takes -0.0 for 0.0."""
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _rope_case(dtype, dim, seed):
    """A rotary table for head_dim `dim` and q/k views of a fused qkv, some of it zeros of
    either sign (their products' signs are part of the bits)."""
    rope = RotaryEmbedding(msgspec.structs.replace(CONFIG, head_dim=dim), 256, dtype,
                           torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads = CONFIG.num_heads, CONFIG.num_kv_heads
    qkv = torch.randn(9, (heads + 2 * kv_heads) * dim, generator=gen)
    qkv[0, : 2 * dim] = 0.0
    qkv[1, : 2 * dim] = -0.0
    qkv = qkv.to(dtype)
    q = qkv[:, : heads * dim].view(9, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(9, kv_heads, dim)
    return rope, q, k, torch.tensor([0, 1, 2, 40, 41, 200, 3, 255, 17])


@pytest.mark.parametrize("dtype", DTYPES)
# 16: half a head (8) is one AVX2 vector and below AVX-512's; 40: 16 wide then a tail
@pytest.mark.parametrize("dim", [16, 40, 64, 128])
def test_rope_gives_the_same_bits(compiled, dtype, dim):
    rope, q, k, positions = _rope_case(dtype, dim, dim)
    q_out, k_out = CpuKernelOps(compiled).rope(rope, q, k, positions)
    assert torch.equal(_bits(q_out), _bits(rope.apply(q, positions)))
    assert torch.equal(_bits(k_out), _bits(rope.apply(k, positions)))


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("width", [1536, 40])  # 40: the scalar tail after 16-wide blocks
def test_silu_and_mul(compiled, rows, width):
    gen = torch.Generator().manual_seed(rows)
    x = (4 * torch.randn(rows, 2 * width, generator=gen))
    expected = TorchOps().silu_and_mul(x)
    torch.testing.assert_close(compiled.silu_and_mul(x), expected, rtol=4e-7, atol=1e-7)
    x16 = x.to(torch.bfloat16)
    got, want = compiled.silu_and_mul(x16), TorchOps().silu_and_mul(x16)
    # The exp polynomial lands on the other side of a bfloat16 rounding at most rarely.
    differ = got != want
    assert differ.float().mean() < 1e-3
    torch.testing.assert_close(got, want, rtol=8e-3, atol=0)


def _paged_case(dtype, lengths, heads, kv_heads, dim, page_size, seed):
    """Random caches, each sequence's pages scattered through them: q, caches, table."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lengths) + 5
    slots = num_pages * page_size
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    width = max(-(-n // page_size) for n in lengths)
    table = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, n in enumerate(lengths):
        count = -(-n // page_size)
        table[b, :count] = torch.tensor([order.pop() for _ in range(count)])
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, table


def _float64_attention(q, k_cache, v_cache, table, lengths, page_size):
    out = []
    for b, n in enumerate(lengths):
        slots = torch.cat([torch.arange(p * page_size, (p + 1) * page_size)
                           for p in table[b].tolist()])[:n]
        k, v = k_cache[slots].double(), v_cache[slots].double()  # [n, KVH, D]
        o = F.scaled_dot_product_attention(
            q[b].double().unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True
        )
        out.append(o.squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    # SmolLM2 and no grouping (whole groups at once); a group of 5 (one head at a time);
    # a dim with no 16-wide path (scalar)
    [(9, 3, 64), (4, 4, 128), (10, 2, 64), (8, 2, 24)],
)
def test_decode_attention_reads_pages_in_place(compiled, dtype, heads, kv_heads, dim):
    lengths = [1, 15, 16, 17, 100, 333]
    page_size = 16
    q, k_cache, v_cache, table = _paged_case(dtype, lengths, heads, kv_heads, dim, page_size, 7)
    lens = torch.tensor(lengths)
    got = compiled.decode_attention(q, k_cache, v_cache, table, lens, page_size, dim**-0.5)
    want = _float64_attention(q, k_cache, v_cache, table, lengths, page_size)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bfloat16: the output's own rounding
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_decode_attention_refuses_a_length_past_its_pages(compiled):
    q, k_cache, v_cache, table = _paged_case(torch.float32, [20], 4, 2, 16, 16, 1)
    with pytest.raises(RuntimeError, match="does not fit its page table"):
        compiled.decode_attention(q, k_cache, v_cache, table, torch.tensor([33]), 16, 0.25)


def test_a_float16_cache_stays_on_the_torch_path(compiled):
    backend = TorchAttentionBackend(1, 8, 4, 2, 16, torch.float16, torch.device("cpu"),
                                    kernels=compiled)
    assert backend.kernels is None
    assert CpuKernelOps(compiled).silu_and_mul(torch.ones(2, 8, dtype=torch.float16)).dtype \
        == torch.float16


def test_torch_backend_decodes_alike_with_and_without_them(compiled):
    """The backend's decode step through the kernel against its gather + SDPA path, on the
    same cache contents and chunks."""
    page_size, kv_heads, heads, dim = 4, 2, 4, 16
    free_pages = list(range(31, 0, -1))  # handed out high to low: no page is where its index is
    chunks = []
    for context in (3, 9, 14):
        pages = [free_pages.pop(0) for _ in range(-(-(context + 1) // page_size))]
        chunks.append(ScheduledChunk(SimpleNamespace(pages=pages), start=context, num_tokens=1))
    plain = TorchAttentionBackend(1, 32, page_size, kv_heads, dim, torch.float32,
                                  torch.device("cpu"))
    fast = TorchAttentionBackend(1, 32, page_size, kv_heads, dim, torch.float32,
                                 torch.device("cpu"), kernels=compiled)
    gen = torch.Generator().manual_seed(5)
    for backend in (plain, fast):
        backend.k_cache[0].copy_(torch.randn(plain.k_cache[0].shape, generator=gen))
        backend.v_cache[0].copy_(torch.randn(plain.v_cache[0].shape, generator=gen))
        gen.manual_seed(5)
    q = torch.randn(3, heads, dim, generator=gen)
    k = torch.randn(3, kv_heads, dim, generator=gen)
    v = torch.randn(3, kv_heads, dim, generator=gen)
    outs = [b.attend(0, q, k, v, b.prepare(chunks)) for b in (plain, fast)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(plain.k_cache[0], fast.k_cache[0])


# ------------------------------------------------------- GGUF block-quantized linear


@pytest.fixture(scope="module")
def smollm2():
    """The default model's config, dense float32 weights and its GGUF blocks."""
    path = default_model_path()
    config = load_model_config(path)
    return config, load_weights(path, config, torch.float32), load_quantized_weights(path, config)


def _dequantize(q: QuantizedWeight, in_features: int) -> torch.Tensor:
    """The GGUF formulas in numpy float32, independent of the kernel."""
    rows = q.blocks.numpy()
    if q.kind == BLOCK_KINDS["Q4_1"]:
        blk = rows.reshape(rows.shape[0], -1, 20)
        d = blk[..., 0:2].copy().view(np.float16).astype(np.float32)
        m = blk[..., 2:4].copy().view(np.float16).astype(np.float32)
        nibbles = np.concatenate([blk[..., 4:] & 0xF, blk[..., 4:] >> 4], axis=-1)
        w = nibbles.astype(np.float32) * d + m
    else:
        blk = rows.reshape(rows.shape[0], -1, 34)
        d = blk[..., 0:2].copy().view(np.float16).astype(np.float32)
        w = blk[..., 2:].copy().view(np.int8).astype(np.float32) * d
    return torch.from_numpy(w.reshape(rows.shape[0], in_features))


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.3.self_attn.k_proj.weight",
                                  "model.layers.7.mlp.down_proj.weight",
                                  "model.embed_tokens.weight"])
def test_blocks_load_in_the_dense_weights_row_order(smollm2, name):
    """q/k rows un-permuted like the dense load, Q4_1 and Q8_0 alike."""
    _, dense, quantized = smollm2
    weight = dense[name]
    assert torch.equal(_dequantize(quantized[name], weight.shape[1]), weight)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight",
                                  "model.embed_tokens.weight"])
@pytest.mark.parametrize("rows", [1, 3, 4, 17])
def test_quantized_linear_float32_uses_the_exact_weights(compiled, smollm2, name, rows):
    _, dense, quantized = smollm2
    weight, q = dense[name], quantized[name]
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    want = x.double() @ weight.double().T
    got = compiled.quantized_linear(x, compiled.pack_blocks(q.blocks, q.kind), q.kind)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.0.mlp.down_proj.weight",
                                  "model.embed_tokens.weight"])
@pytest.mark.parametrize("rows", [1, 4, 21])
def test_quantized_linear_bfloat16_uses_the_dense_bfloat16_weights(compiled, smollm2, name,
                                                                    rows):
    """Each weight rounded to the bfloat16 the dense model holds: the result is oneDNN's
    matmul over the dense bfloat16 weights, bit for bit but for a rare last-bit rounding
    of a sum taken in another order. The exact (unrounded) weights would give other bits
    in a third or more of the outputs."""
    if not compiled.bf16_quantized:
        pytest.skip("this build has no AVX512-BF16 path: bfloat16 models use the dense path")
    _, dense, quantized = smollm2
    weight, q = dense[name].to(torch.bfloat16), quantized[name]
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    x = x.to(torch.bfloat16)
    got = compiled.quantized_linear(x, compiled.pack_blocks(q.blocks, q.kind), q.kind)
    want = F.linear(x, weight)
    assert (got == want).float().mean() > 0.999
    torch.testing.assert_close(got, want, atol=1e-5, rtol=8e-3)  # one bfloat16 step apart
    exact = (x.double() @ dense[name].double().T).to(torch.bfloat16)
    assert (got == exact).float().mean() < 0.9


def test_the_model_multiplies_decode_batches_by_the_blocks(compiled, smollm2):
    config, dense, quantized = smollm2
    ops = CpuKernelOps(compiled)
    model = LlamaModel(config, dense, 256, torch.float32, torch.device("cpu"), ops=ops,
                       quantized=quantized)
    assert len(ops._quantized) == 4 * config.num_layers + 1  # every linear and the LM head
    layer = model.layers[0]
    # A float32 model multiplies up to 16 rows by the blocks (a bfloat16 one up to 4).
    x = torch.randn(QUANTIZED_MAX_ROWS_FLOAT32, config.hidden_size, generator=torch.Generator())
    blocks = ops._quantized[id(layer.gate_up_weight)]
    assert torch.equal(ops.linear(x, layer.gate_up_weight),
                       compiled.quantized_linear(x, blocks.blocks, blocks.kind))
    torch.testing.assert_close(ops.linear(x, layer.gate_up_weight),
                               F.linear(x, layer.gate_up_weight), atol=1e-4, rtol=1e-5)
    big = torch.randn(QUANTIZED_MAX_ROWS_FLOAT32 + 1, config.hidden_size)
    assert torch.equal(ops.linear(big, layer.gate_up_weight), F.linear(big, layer.gate_up_weight))


def _both_builds():
    """The native and avx2 builds, or a skip naming why this machine cannot compare them."""
    if not (cpu_runs("native") and cpu_runs("avx2")):
        pytest.skip("this CPU cannot run the avx2 build")
    if "avx512f" not in cpu_flags():
        # Both builds take the AVX2 paths here: nothing to compare, and a second compile.
        pytest.skip("no AVX-512 here: the native build is the AVX2 path")
    native, avx2 = kernels_for("native"), kernels_for("avx2")
    if native is None or avx2 is None:
        pytest.skip("no C++ compiler: the engine runs plain torch ops")
    return native, avx2


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_the_avx2_linear_sums_as_the_avx512_one_in_float32(smollm2, rows):
    """The AVX2 path adds every float32 product in the AVX-512 path's order: an AVX2-only
    machine and an AVX-512 one give a row the same bits, for the blocks and dense weights."""
    native, avx2 = _both_builds()
    _, dense, quantized = smollm2
    q = quantized["model.layers.0.mlp.down_proj.weight"]
    weight = dense["model.layers.0.mlp.down_proj.weight"]
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
    assert avx2.simd == "avx2"
    results = [(m.quantized_linear(x, m.pack_blocks(q.blocks, q.kind), q.kind),
                m.dense_linear(x, weight)) for m in (native, avx2)]
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


# ------------------------------------- bfloat16 weights under a float32 model (issue 29)


def test_dense_linear_widens_bfloat16_weights_exactly(compiled):
    """bf16 -> float32 is exact, so a bfloat16 weight under float32 x gives the bits of the
    same weight stored in float32, at decode row counts and past the unpacking cut."""
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(200, 576, generator=gen) / 24).bfloat16()
    for rows in (1, 4, 9, 70):
        x = torch.randn(rows, 576, generator=gen)
        assert torch.equal(compiled.dense_linear(x, weight),
                           compiled.dense_linear(x, weight.float()))
    with pytest.raises(RuntimeError, match="x's dtype"):  # never the other way round
        compiled.dense_linear(x.bfloat16(), weight.float())


def _bf16_exact_weights():
    return {name: w.bfloat16().float() for name, w in random_weights().items()}


def test_a_float32_model_holds_bf16_exact_weights_in_bfloat16(compiled):
    """Where the CPU has no bf16 dot product (the avx2 build here), a float32 model keeps
    the linear weights of a bf16 checkpoint in bfloat16 (half the bytes per decode step)
    and its linears give F.linear's float32 results at every row count; weights that are
    not bf16-exact stay float32. Where the CPU has one, nothing changes (`--dtype auto`
    runs bfloat16 there)."""
    exact = _bf16_exact_weights()
    ops = CpuKernelOps(compiled)
    model = LlamaModel(CONFIG, exact, 64, torch.float32, torch.device("cpu"), ops=ops)
    layer = model.layers[0]
    held = torch.float32 if compiled.bf16_quantized else torch.bfloat16
    assert layer.gate_up_weight.dtype == held and model.lm_head.dtype == held
    assert model.embed.dtype == torch.float32  # lookups stay in the model's dtype
    want_weight = torch.cat([exact["model.layers.0.mlp.gate_proj.weight"],
                             exact["model.layers.0.mlp.up_proj.weight"]])
    gen = torch.Generator().manual_seed(6)
    for rows in (1, 4, WIDENED_MAX_ROWS, WIDENED_MAX_ROWS + 1):  # the kernel, then F.linear
        x = torch.randn(rows, CONFIG.hidden_size, generator=gen)
        torch.testing.assert_close(ops.linear(x, layer.gate_up_weight),
                                   F.linear(x, want_weight), atol=1e-5, rtol=1e-5)
    inexact = CpuKernelOps(compiled).stored_weight(torch.full((8, 64), 1 + 2**-12))
    assert inexact.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_avx2_norms_and_rope_are_the_avx512_ones(dtype):
    """The norms' sum of squares runs through sixteen lane sums and one tree on both builds
    (one 16-lane vector or two 8-lane ones), and RoPE is elementwise: the same bits, tails
    included, though neither is always torch's (see _assert_same_norm)."""
    native, avx2 = _both_builds()
    gen = torch.Generator().manual_seed(11)
    for shape in [(300, 576), (5, 9, 64), (6, 3, 40), (4, 100)]:
        x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
        delta = torch.randn(*shape, generator=gen).to(dtype).view(-1, shape[-1])
        weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
        assert torch.equal(_bits(native.rms_norm(x, weight, 1e-6)),
                           _bits(avx2.rms_norm(x, weight, 1e-6)))
        h = x.view(-1, shape[-1])
        for a, b in zip(native.add_rms_norm(h, delta, weight, 1e-6),
                        avx2.add_rms_norm(h, delta, weight, 1e-6), strict=True):
            assert torch.equal(_bits(a), _bits(b))
    for dim in (40, 64):
        rope, q, k, positions = _rope_case(dtype, dim, 12)
        args = (q, k, rope.cos, rope.sin, positions)
        assert torch.equal(_bits(native.rope(*args)), _bits(avx2.rope(*args)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_avx2_silu_and_mul_is_the_avx512_one(dtype):
    """Elementwise, the 8-lane path takes the 16-lane one's steps: the same bits."""
    native, avx2 = _both_builds()
    x = (4 * torch.randn(5, 2 * 1544, generator=torch.Generator().manual_seed(8))).to(dtype)
    assert torch.equal(native.silu_and_mul(x), avx2.silu_and_mul(x))
