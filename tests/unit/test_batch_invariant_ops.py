"""The pieces of --batch-invariant (issue 20), each against the property it must have: a row's
result is the same bits whatever rows come with it (the linears, dense and block-quantized,
and attention, however a prompt is chunked), close to the plain torch result, and the mode
refuses, at start, what it cannot make invariant."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.cpu_ops import CpuKernelOps
from engine.layers.flashinfer_ops import tiled_linear
from engine.layers.ops import make_ops
from engine.models.llama import LlamaModel
from engine.models.registry import load_model_config, load_quantized_weights
from engine.request.batch import ScheduledChunk
from shared.model_source import default_model_path
from sluice.cli import engine_config, parse_args
from tests.unit.cli_builders import serve_argvs
from tests.unit.engine_builders import CONFIG, random_weights

DTYPES = [torch.float32, torch.bfloat16]
# Row counts around every tile edge: 4 rows x 6 outputs a register tile, 64 rows a pass.
SUB_BATCHES = [(0, 1), (5, 1), (0, 2), (1, 3), (0, 4), (3, 5), (2, 7), (0, 8), (9, 13),
               (0, 64), (1, 64), (0, 65), (60, 70)]


def assert_rows_invariant(linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x) row by row equals linear over any slice of x: same bits."""
    full = linear(x)
    for start, count in SUB_BATCHES:
        part = linear(x[start : start + count].contiguous())
        assert torch.equal(part, full[start : start + count]), (start, count)
    return full


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(70, 64), (960, 576), (576, 1536)])
def test_dense_linear_gives_a_row_the_same_bits_in_any_batch(compiled, dtype, shape):
    gen = torch.Generator().manual_seed(shape[0])
    weight = (torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(dtype)
    x = torch.randn(130, shape[1], generator=gen).to(dtype)
    got = assert_rows_invariant(lambda rows: compiled.dense_linear(rows, weight), x)
    want = x.double() @ weight.double().T
    tolerance = 1e-5 if dtype is torch.float32 else 1e-2  # bfloat16: the output's rounding
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_dense_linear_refuses_what_it_cannot_take(compiled):
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        compiled.dense_linear(torch.randn(3, 40), torch.randn(8, 40))
    with pytest.raises(RuntimeError, match="x's dtype"):
        compiled.dense_linear(x.bfloat16(), torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="x's dtype"):
        compiled.dense_linear(x, torch.randn(8, 64).half())
    with pytest.raises(RuntimeError, match="out, in"):
        compiled.dense_linear(x, torch.randn(8, 32))


@pytest.fixture(scope="module")
def blocks():
    """The default checkpoint's Q8_0 or Q4_1 blocks of one MLP weight."""
    path = default_model_path()
    quantized = load_quantized_weights(path, load_model_config(path))
    return quantized["model.layers.0.mlp.down_proj.weight"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_linear_gives_a_row_the_same_bits_in_any_batch(compiled, blocks, dtype):
    """Past the 4 rows the default mode gives it: the mode sends every batch there."""
    packed = compiled.pack_blocks(blocks.blocks, blocks.kind)
    in_features = blocks.blocks.shape[1] // (20 if blocks.kind == 0 else 34) * 32  # GGUF bytes
    x = torch.randn(130, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert_rows_invariant(lambda rows: compiled.quantized_linear(rows, packed, blocks.kind), x)


# ---------------------------------------------------------------- attention


def _chunks(prompt_len: int, splits: list[int], pages: list[int]) -> list[list[ScheduledChunk]]:
    """A prompt's steps, one list of chunks per step, as the scheduler would cut it."""
    seq = SimpleNamespace(pages=pages, token_ids=list(range(prompt_len)))
    steps, start = [], 0
    for n in splits:
        steps.append([ScheduledChunk(seq, start, n)])
        start += n
    assert start == prompt_len
    return steps


def _attend(backend, steps, q, k, v) -> torch.Tensor:
    """Runs the steps through layer 0 and returns every token's output, in order."""
    outs, row = [], 0
    for chunks in steps:
        n = sum(c.num_tokens for c in chunks)
        rows = slice(row, row + n)
        outs.append(backend.attend(0, q[rows], k[rows], v[rows], backend.prepare(chunks)))
        row += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_gives_a_token_the_same_bits_however_its_prompt_is_chunked(compiled, dtype):
    page_size, kv_heads, heads, dim, length = 4, 2, 6, 64, 23
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(length, heads, dim, generator=gen).to(dtype)
    k = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(length, kv_heads, dim, generator=gen).to(dtype)
    pages = [9, 2, 7, 4, 11, 1]

    def backend(invariant: bool) -> TorchAttentionBackend:
        return TorchAttentionBackend(1, 12, page_size, kv_heads, dim, dtype,
                                     torch.device("cpu"), kernels=compiled,
                                     batch_invariant=invariant)

    invariant = [_attend(backend(True), _chunks(length, splits, pages), q, k, v)
                 for splits in ([23], [5, 7, 1, 10], [1] * 23, [16, 6, 1])]
    for other in invariant[1:]:
        assert torch.equal(other, invariant[0])
    plain = _attend(backend(False), _chunks(length, [5, 7, 1, 10], pages), q, k, v)
    tolerance = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(invariant[0], plain, atol=tolerance, rtol=tolerance)


def test_attention_in_one_step_with_others_is_attention_alone(compiled):
    """Two sequences' chunks in one step give each the bits it gets alone."""
    page_size, dim = 4, 64
    backend = TorchAttentionBackend(1, 16, page_size, 1, dim, torch.float32,
                                    torch.device("cpu"), kernels=compiled, batch_invariant=True)
    gen = torch.Generator().manual_seed(3)
    a = SimpleNamespace(pages=[3, 5, 8], token_ids=list(range(10)))
    b = SimpleNamespace(pages=[1, 12], token_ids=list(range(6)))
    q, k, v = (torch.randn(16, 1, dim, generator=gen) for _ in range(3))
    together = backend.attend(0, q, k, v, backend.prepare(
        [ScheduledChunk(a, 0, 10), ScheduledChunk(b, 0, 6)]))
    alone_a = backend.attend(0, q[:10], k[:10], v[:10], backend.prepare([ScheduledChunk(a, 0, 10)]))
    alone_b = backend.attend(0, q[10:], k[10:], v[10:], backend.prepare([ScheduledChunk(b, 0, 6)]))
    assert torch.equal(together, torch.cat([alone_a, alone_b]))


# ---------------------------------------------------------------- the mode's edges


def test_the_mode_needs_the_kernels():
    with pytest.raises(ValueError, match="CPU kernels"):
        TorchAttentionBackend(1, 4, 4, 1, 16, torch.float32, torch.device("cpu"),
                              kernels=None, batch_invariant=True)


def test_the_mode_never_calls_onednn(compiled, monkeypatch):
    ops = make_ops("torch", torch.device("cpu"), batch_invariant=True)
    assert isinstance(ops, CpuKernelOps) and ops.batch_invariant
    monkeypatch.setattr(F, "linear", None)  # any call would raise
    model = LlamaModel(CONFIG, random_weights(), 64, torch.bfloat16, torch.device("cpu"),
                       ops=ops)
    x = torch.randn(200, CONFIG.hidden_size).bfloat16()  # past every row cut of the default
    assert ops.linear(x, model.layers[0].gate_up_weight).shape == (200, 2 * 128)


def test_the_mode_refuses_a_weight_its_kernel_cannot_take(compiled):
    ops = make_ops("torch", torch.device("cpu"), batch_invariant=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.prepack(torch.randn(8, 40))
    with pytest.raises(ValueError, match="float16"):
        ops.prepack(torch.randn(8, 64).half())


def test_the_mode_runs_on_a_cpu_or_with_flashinfer_only():
    with pytest.raises(ValueError, match="CPU or with flashinfer"):
        make_ops("torch", torch.device("meta"), batch_invariant=True)


@pytest.mark.parametrize("rows", [1, 63, 64, 65, 130])
def test_tiled_linear_is_the_linear(rows):
    """The CUDA mode's fixed-shape cuBLAS calls, shape-checked on the CPU: padding rows
    never reach the result."""
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = (torch.randn(rows, 32, generator=gen), torch.randn(8, 32, generator=gen),
                       torch.randn(8, generator=gen))
    got = tiled_linear(x, weight, bias, 64)
    torch.testing.assert_close(got, F.linear(x, weight, bias))


def test_the_flag_reaches_the_engine_config():
    on = engine_config(parse_args(["engine", "--batch-invariant"]), "ipc:///x")
    off = engine_config(parse_args(["engine"]), "ipc:///x")
    assert on.batch_invariant and not off.batch_invariant


def test_vllms_environment_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert engine_config(parse_args(["engine"]), "ipc:///x").batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not engine_config(parse_args(["engine"]), "ipc:///x").batch_invariant


def test_serve_passes_the_mode_to_its_engine(monkeypatch):
    for flags in ([], ["--batch-invariant"]):
        engine_argv, _ = serve_argvs(monkeypatch, flags)
        config = engine_config(parse_args(engine_argv), "ipc:///x")
        assert config.batch_invariant == bool(flags)
