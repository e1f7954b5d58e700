"""--kv-cache-dtype: the narrow KV cache's storage, scales, page count, refusals, and an
engine core over it that stays close to the float32 cache."""

from types import SimpleNamespace

import msgspec
import pytest
import torch
import transformers
from safetensors.torch import save_file

from engine.attention.kv_calibration import MARGIN, int8_scales
from engine.attention.kv_dtype import (
    INT8_SCALES,
    checkpoint_scales,
    dequantize,
    kv_cache_dtype,
    quantize,
    stored_dtype,
)
from engine.attention.selector import create_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.config import MlaConfig
from engine.models.llama import LlamaModel
from engine.models.registry import load_model_config, load_weights
from engine.process.load import kv_pages_for
from engine.request.batch import ScheduledChunk
from shared.config import EngineConfig
from sluice import cli
from tests.unit.cli_builders import serve_argvs
from tests.unit.engine_builders import (
    CONFIG,
    build_core,
    drain,
    hf_config_kwargs,
    prompts,
    random_weights,
    request,
    run,
)
from tests.unit.kquant_builders import LlamaShape, engine_core, write_q4_k_m

CPU = torch.device("cpu")


@pytest.mark.parametrize("name, dtype, step", [
    ("fp8", torch.float8_e4m3fn, 2**-3), ("fp8_e4m3", torch.float8_e4m3fn, 2**-3),
    ("fp8_e5m2", torch.float8_e5m2, 2**-2), ("bfloat16", torch.bfloat16, 2**-7),
    ("float16", torch.float16, 2**-10)])
def test_float_round_trip_within_half_a_step(name, dtype, step):
    """Relative error at most half the type's step (2^-mantissa bits) in its normal range,
    at scale 1 and 0.5."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    x = x[x.abs() > 0.05]  # inside every type's normal range
    assert stored_dtype(name, torch.float32) == dtype
    for scale in (1.0, 0.5):
        stored = quantize(x, scale if dtype.itemsize == 1 else 1.0, dtype)
        assert stored.dtype == dtype
        back = dequantize(stored, scale if dtype.itemsize == 1 else 1.0, torch.float32)
        assert ((back - x).abs() / x.abs()).max() <= step / 2


def test_int8_round_trip_and_clipping():
    scale = 0.1
    x = torch.tensor([0.0, 0.04, 0.06, -0.26, 12.7, 12.8, -500.0])
    stored = quantize(x, scale, torch.int8)
    assert stored.tolist() == [0, 0, 1, -3, 127, 127, -127]
    back = dequantize(stored, scale, torch.float32)
    inside = x.abs() <= 127 * scale
    assert ((back - x)[inside].abs() <= scale / 2 + 1e-6).all()


def test_fp8_clips_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 448.0])
    assert dequantize(quantize(x, 1.0, torch.float8_e4m3fn), 1.0, torch.float32).tolist() == [
        448.0, -448.0, 448.0]
    assert torch.isfinite(dequantize(quantize(x * 1e3, 1.0, torch.float8_e5m2), 1.0,
                                     torch.float32)).all()


def test_auto_or_the_engines_own_dtype_is_no_narrow_cache():
    assert kv_cache_dtype("auto", torch.float32, 2) is None
    assert kv_cache_dtype("bfloat16", torch.bfloat16, 2) is None
    with pytest.raises(ValueError, match="choose one of auto"):
        kv_cache_dtype("fp4", torch.float32, 2)


def test_fixed_scales_without_the_checkpoints():
    int8 = kv_cache_dtype("int8", torch.float32, 3)
    assert (int8.k_scales, int8.v_scales) == ((INT8_SCALES[0],) * 3, (INT8_SCALES[1],) * 3)
    fp8 = kv_cache_dtype("fp8", torch.bfloat16, 3, "/no/such/model.gguf")
    assert fp8.k_scales == fp8.v_scales == (1.0, 1.0, 1.0) and fp8.one_byte


def test_the_checkpoints_scales_per_layer(tmp_path):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.1.self_attn.kv_scale": torch.tensor(2.0),
               "model.embed_tokens.weight": torch.zeros(2, 2)},
              str(tmp_path / "model.safetensors"))
    assert checkpoint_scales(str(tmp_path), 2) == ((0.5, 2.0), (0.25, 2.0))
    kv = kv_cache_dtype("fp8_e5m2", torch.float32, 2, str(tmp_path))
    assert kv.k_scales == (0.5, 2.0) and "checkpoint" in kv.source
    with pytest.raises(ValueError, match="not for layer 2"):
        checkpoint_scales(str(tmp_path), 3)
    save_file({"model.layers.0.self_attn.kv_scale": torch.tensor(0.0)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="must be positive"):
        checkpoint_scales(str(tmp_path), 1)


@pytest.mark.parametrize("name, times", [("auto", 1), ("bfloat16", 2), ("float16", 2),
                                          ("fp8", 4), ("fp8_e5m2", 4), ("int8", 4)])
def test_kv_cache_memory_buys_more_pages(name, times):
    config = EngineConfig(model="m", served_model_name="m", request_address="x",
                          kv_cache_memory_gb=0.5, kv_cache_dtype=name)
    auto = kv_pages_for(EngineConfig(model="m", served_model_name="m", request_address="x",
                                     kv_cache_memory_gb=0.5), CONFIG, torch.float32)
    assert kv_pages_for(config, CONFIG, torch.float32) == times * auto


def test_the_cache_is_stored_narrow_and_read_back_in_the_engines_dtype():
    kv = kv_cache_dtype("fp8", torch.float32, 1)
    backend = TorchAttentionBackend(1, 4, 4, 2, 16, torch.float32, CPU, kv=kv)
    assert backend.k_cache[0].dtype == torch.float8_e4m3fn
    assert backend.k_cache[0].untyped_storage().nbytes() == 4 * 4 * 2 * 16


def test_refused_where_it_cannot_run():
    kv = kv_cache_dtype("int8", torch.float32, CONFIG.num_layers)
    with pytest.raises(ValueError, match="--batch-invariant.*drop --kv-cache-dtype"):
        TorchAttentionBackend(1, 4, 4, 2, 16, torch.float32, CPU, batch_invariant=True, kv=kv)
    with pytest.raises(ValueError, match="the flashinfer backend keeps its KV cache in --dtype"):
        create_attention_backend("flashinfer", CONFIG, 4, 4, torch.float32, CPU, kv=kv)
    mla = msgspec.structs.replace(CONFIG, mla=MlaConfig(16, 16, 8, 16, None, 0.2))
    with pytest.raises(ValueError, match="multi-head latent attention"):
        create_attention_backend("torch", mla, 4, 4, torch.float32, CPU, kv=kv)


@pytest.mark.parametrize("value", ["fp4", "FP8", "", "float32"])
def test_an_unknown_value_is_a_one_line_parse_error(value, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["engine", "--kv-cache-dtype", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"argument --kv-cache-dtype: {value!r}: choose one of auto, "
                            "bfloat16, float16, fp8, fp8_e4m3, fp8_e5m2, int8"), err


def test_the_flag_reaches_the_engine_and_serve_forwards_it(monkeypatch):
    args = cli.parse_args(["engine", "--kv-cache-dtype", "fp8_e5m2"])
    assert cli.engine_config(args, "ipc:///tmp/x").kv_cache_dtype == "fp8_e5m2"
    assert cli.engine_config(cli.parse_args(["engine"]), "ipc:///x").kv_cache_dtype == "auto"
    engine, _ = serve_argvs(monkeypatch, ["--kv-cache-dtype", "int8"])
    assert engine[engine.index("--kv-cache-dtype") + 1] == "int8"


@pytest.mark.parametrize("name, bound, share", [
    ("bfloat16", 0.02, 1.0), ("fp8", 0.2, 0.6), ("int8", 0.3, 0.6)])
def test_a_core_over_a_narrow_cache_stays_close_to_float32(name, bound, share):
    """The tiny random Llama, prefilled in chunks (budget 24) and decoded, 4 requests of 16
    tokens: every logit up to each request's first differing token within `bound` of the
    float32 cache's (its logits lie within +-4.3; measured: bfloat16 0.006, fp8 0.09, int8
    with the fixed scales 0.14), and at least `share` of the tokens generated before it
    (measured: bfloat16 all 64, fp8 48, int8 44: this random model's near-ties)."""
    weights = random_weights()
    batch = prompts([5, 30, 60, 17])
    reqs = lambda: [request(f"r{i}", p, max_tokens=16) for i, p in enumerate(batch)]  # noqa: E731
    base_core, base_rec = build_core(weights, budget=24)
    base = run(base_core, reqs())
    core, rec = build_core(weights, budget=24,
                           kv=kv_cache_dtype(name, torch.float32, CONFIG.num_layers))
    assert core.runner.backend.k_cache[0].dtype == stored_dtype(name, torch.float32)
    got = run(core, reqs())
    same = total = 0
    for rid, want in base.items():
        tokens = got[rid].tokens
        pairs = enumerate(zip(tokens, want.tokens, strict=True))
        agree = next((i for i, (a, b) in pairs if a != b), len(tokens))
        same, total = same + agree, total + len(tokens)
        for a, b in zip(rec.logits[rid][: agree + 1], base_rec.logits[rid][: agree + 1],
                        strict=True):
            assert (a - b).abs().max() < bound
    assert same >= share * total


@pytest.mark.parametrize("argv, says", [
    (["--kv-cache-dtype", "fp8", "--batch-invariant"],
     "--kv-cache-dtype fp8 cannot run with --batch-invariant"),
    (["--kv-cache-dtype", "int8", "--attention-backend", "flashinfer"],
     "--kv-cache-dtype int8 is stored on the torch attention backend only"),
])
def test_refused_at_start_in_one_line(argv, says):
    with pytest.raises(SystemExit, match=says) as e:
        cli.check_startup(cli.parse_args(["serve", "--device", "cpu", *argv]))
    assert str(e.value).startswith("sluice: ") and "\n" not in str(e.value)


def test_the_engines_own_dtype_named_passes_the_checks():
    cli.check_startup(cli.parse_args(["serve", "--device", "cpu", "--port", "0", "--dtype",
                                      "bfloat16", "--kv-cache-dtype", "bfloat16",
                                      "--batch-invariant"]))


# ------------------------------------------------------------- the compiled decode kernel

NARROW = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.float16, torch.bfloat16]


def _narrow_case(stored, heads, kv_heads, dim, lengths, page_size=16):
    """A random paged case whose caches hold every value of the narrow type (fp8: all 256
    bytes but NaN; int8: -127..127), and the same caches widened for the reference."""
    gen = torch.Generator().manual_seed(dim + heads)
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    shape = (num_pages * page_size, kv_heads, dim)
    if stored in (torch.float8_e4m3fn, torch.float8_e5m2):
        caches = []
        for _ in range(2):
            bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            bits[~bits.view(stored).float().isfinite()] = 0  # the cache never holds NaN
            caches.append(bits.view(stored))
    elif stored == torch.int8:
        caches = [torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
                  for _ in range(2)]
    else:
        caches = [torch.randn(shape, generator=gen).to(stored) for _ in range(2)]
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.zeros(len(lengths), max(-(-n // page_size) for n in lengths), dtype=torch.long)
    for b, n in enumerate(lengths):
        table[b, : -(-n // page_size)] = torch.tensor([order.pop() for _ in range(-(-n // 16))])
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    return q, caches, table


@pytest.mark.parametrize("stored", NARROW)
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (10, 2, 64), (4, 4, 128),
                                                  (8, 2, 24)])
def test_the_kernel_reads_a_narrow_cache_as_widened(compiled, stored, heads, kv_heads, dim):
    """Every fp8 byte pattern (incl. subnormals) widened in registers (AVX-512, AVX2) or
    scalar (dim 24) gives the float64 attention over the torch-widened cache, scales and
    all: the kernel's K scale folded into the query's, its V scale into the output."""
    lengths = [1, 17, 100, 250]
    q, (k8, v8), table = _narrow_case(stored, heads, kv_heads, dim, lengths)
    # Scales that bring the largest stored value to about 6-9, as a real cache's.
    ks = vs = {torch.float8_e4m3fn: 0.02, torch.float8_e5m2: 1e-4, torch.int8: 0.05}.get(
        stored, 1.0)
    got = compiled.decode_attention(q, k8, v8, table, torch.tensor(lengths), 16,
                                    dim**-0.5 * ks, vs)
    k, v = k8.double() * ks, v8.double() * vs
    out = []
    for b, n in enumerate(lengths):
        slots = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in table[b].tolist()])[:n]
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[b].double().unsqueeze(1), k[slots].transpose(0, 1), v[slots].transpose(0, 1),
            enable_gqa=True).squeeze(1))
    torch.testing.assert_close(got.double(), torch.stack(out), atol=2e-5, rtol=1e-5)


def test_the_backend_decodes_a_narrow_cache_through_the_kernel(compiled):
    """The backend's int8 decode step through the kernel equals its torch path (gather and
    widen), and the kernel is the one taken."""
    kv = kv_cache_dtype("int8", torch.float32, 1)
    made = [TorchAttentionBackend(1, 32, 4, 2, 64, torch.float32, CPU, kernels=kernels, kv=kv)
            for kernels in (None, compiled)]
    assert made[1].kernels is compiled
    chunks = [ScheduledChunk(SimpleNamespace(pages=[9, 3, 7, 1]), start=s, num_tokens=1)
              for s in (2, 9, 14)]
    gen = torch.Generator().manual_seed(3)
    filled = torch.randint(-127, 128, made[0].k_cache[0].shape, generator=gen, dtype=torch.int8)
    for backend in made:
        backend.k_cache[0].copy_(filled)
        backend.v_cache[0].copy_(filled.flip(0))
    q, k, v = (torch.randn(3, n, 64, generator=gen) for n in (4, 2, 2))
    plain, fast = (b.attend(0, q, k, v, b.prepare(chunks)) for b in made)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)


def test_int8_scales_computed_from_one_prefill_of_the_fixed_text():
    """Each layer's largest |K| / |V| of the prefill, times MARGIN, over 127: the same at
    every start, and no value of the text itself clipped."""
    model = LlamaModel(CONFIG, random_weights(), 256, torch.float32, CPU)
    ids = prompts([40])[0]
    k, v = int8_scales(model, CONFIG, ids, torch.float32, CPU, 256)
    assert (k, v) == int8_scales(model, CONFIG, ids, torch.float32, CPU, 256)
    assert len(k) == len(v) == CONFIG.num_layers and min(k + v) > 0
    assert k != v and k[0] != k[1]  # per layer, per K and V: not one fixed number
    # The maxima a plain backend sees over the same prefill.
    backend = TorchAttentionBackend(CONFIG.num_layers, 10, 16, CONFIG.num_kv_heads,
                                    CONFIG.head_dim, torch.float32, CPU)
    seen = []
    attend = backend.attend
    backend.attend = lambda layer, q, kk, vv, meta, sinks=None: (
        seen.append((layer, kk.abs().max(), vv.abs().max())) or attend(layer, q, kk, vv, meta))
    meta = backend.prepare([ScheduledChunk(SimpleNamespace(pages=list(range(3))), 0, 40)])
    model.forward(torch.tensor(ids), torch.arange(40), backend, meta)
    for layer, k_max, v_max in seen:
        assert k[layer] == pytest.approx(float(k_max) * MARGIN / 127)
        assert v[layer] == pytest.approx(float(v_max) * MARGIN / 127)


def test_a_checkpoint_with_kv_scales_loads_and_gives_them(tmp_path):
    """vLLM's FP8-KV checkpoints carry self_attn.k_scale / v_scale beside the weights: the
    weight loader passes them by (it refused them as unexpected tensors), the cache reads
    them."""
    transformers.LlamaConfig(**hf_config_kwargs(head_dim=CONFIG.head_dim)).save_pretrained(
        tmp_path)
    scales = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(0.1 * (i + 1) + j)
              for i in range(CONFIG.num_layers) for j, kind in enumerate("kv")}
    save_file({**random_weights(), **scales}, str(tmp_path / "model.safetensors"))
    config = load_model_config(str(tmp_path))
    assert "model.layers.0.self_attn.k_scale" not in load_weights(str(tmp_path), config,
                                                                   torch.float32)
    kv = kv_cache_dtype("fp8", torch.float32, config.num_layers, str(tmp_path))
    assert kv.k_scales == pytest.approx((0.1, 0.2)) and kv.v_scales == pytest.approx((1.1, 1.2))


def _gguf_decode(path: str, compiled, kv, fused: bool):
    """Every step's hidden rows into the LM head, how many layers ran fused, the tokens."""
    core, ops = engine_core(path, compiled, torch.float32, kv=kv)
    assert core.runner.backend.k_cache[0].dtype == kv.dtype
    model = core.runner.model
    model.fuse_decode_layers = fused
    seen, calls, logits, decode_layer = [], [0], model.logits, ops.decode_layer
    model.logits = lambda hidden: seen.append(hidden.clone()) or logits(hidden)

    def counting(*args):
        calls[0] += 1
        return decode_layer(*args)

    ops.decode_layer = counting
    for i, prompt in enumerate([[1, 5, 9, 200, 3], list(range(40, 60))]):
        core.add(request(f"r{i}", prompt, max_tokens=8))
    results = drain(core)
    return seen, calls[0], [results[f"r{i}"].tokens for i in range(2)]


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_fused_gguf_decode_layers_write_and_read_a_narrow_cache_as_the_per_op_path(
        compiled, tmp_path, name):
    """A GGUF model's decode steps fused into one kernel call a layer store their K/V
    narrow as the per-op path does and attend them alike: the same hidden rows, bit for bit,
    step by step, and the same tokens."""
    path = str(tmp_path / "tiny.gguf")
    write_q4_k_m(path, LlamaShape(layers=2), set())
    kv = msgspec.structs.replace(kv_cache_dtype(name, torch.float32, 2),
                                 k_scales=(0.05, 0.04), v_scales=(0.03, 0.02))
    per_op, none, tokens = _gguf_decode(path, compiled, kv, fused=False)
    fused_rows, calls, fused_tokens = _gguf_decode(path, compiled, kv, fused=True)
    assert none == 0 and calls > 0
    for step, (a, b) in enumerate(zip(fused_rows, per_op, strict=True)):
        assert torch.equal(a, b), step
    assert fused_tokens == tokens
