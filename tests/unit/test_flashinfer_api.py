"""The engine's calls into FlashInfer against the pinned release's real Python API, on CPU.

The backend and the fused ops run against the recording stand-in
(tests/unit/flashinfer_standin.py); every call they make (wrapper constructors, plan, run,
RMSNorm, RoPE, SiLU-and-mul, sampling) is then bound with `inspect.signature(...).bind` to
the real function of the installed FlashInfer, which imports on a CPU, so a renamed or
removed parameter fails here and not on a GPU machine. The installed FlashInfer must be the
pin of pyproject.toml's `cuda` extra (the Makefile installs it, without its CUDA-only
dependencies).

Also here: the batch-invariant mode on the default model's heads (9 query / 3 KV) takes the
tensor-core decode path, whose planner is the one that honours disable_split_kv, and the
mode asks FlashInfer's version, not plan()'s signature, whether that switch exists.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import pytest
import torch

from engine.attention.flashinfer_backend import FlashInferAttentionBackend, release
from engine.models.registry import load_model_config
from shared.model_source import default_model_path
from tests.unit import flashinfer_standin

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def pinned_version() -> str:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["cuda"]
    pins = [re.fullmatch(r"flashinfer-python==(\S+)", req) for req in extra]
    assert len(pins) == 1 and pins[0], f"the cuda extra pins flashinfer-python: {extra}"
    return pins[0].group(1)


@pytest.fixture(scope="module")
def real_flashinfer():
    try:
        import flashinfer
        import flashinfer.sampling
    except ImportError as exc:
        pytest.fail(f"the pinned flashinfer-python is not installed here ({exc}); "
                    "`make install` installs it (--no-deps: it imports on a CPU)")
    return flashinfer


@pytest.fixture(scope="module")
def default_shape():
    """The default model's config (SmolLM2-135M: 9 query / 3 KV heads of 64)."""
    return load_model_config(default_model_path())


def real_target(module, target: str):
    """The real callable a recorded call names, and whether it is a method (takes self)."""
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj, "." in target and not target.startswith("sampling.")


def bind_all(module, calls) -> list[str]:
    """Each recorded call bound to the real function; the ones that do not bind, with why."""
    problems = []
    for call in calls:
        function, is_method = real_target(module, call.target)
        args = (None, *call.args) if is_method else call.args
        try:
            inspect.signature(function).bind(*args, **call.kwargs)
        except TypeError as exc:
            problems.append(f"{call.target}{tuple(call.kwargs)}: {exc}")
    return problems


def test_installed_flashinfer_is_the_pin(real_flashinfer):
    assert real_flashinfer.__version__ == pinned_version() == flashinfer_standin.VERSION


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
def test_backend_calls_bind_to_the_pinned_flashinfer(monkeypatch, real_flashinfer,
                                                     batch_invariant):
    """Constructors, plan and run of both wrappers, CUDA-graph wrappers included, as the
    backend builds them for a tiny model's steps."""
    from engine.models.llama import LlamaModel
    from tests.unit.engine_builders import CONFIG, random_weights
    from tests.unit.test_flashinfer_metadata import _run, _steps

    standin = flashinfer_standin.install(monkeypatch)
    model = LlamaModel(CONFIG, random_weights(), 256, torch.bfloat16, CPU)
    backend = FlashInferAttentionBackend(
        CONFIG.num_layers, 64, 4, CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim,
        torch.bfloat16, CPU, batch_invariant=batch_invariant)
    for step in _steps():  # prefills (one chunked), a mixed step, then decodes only
        _run(model, backend, step)
    backend.enable_decode_graphs([2, 8], max_model_len=256)  # their wrappers, and a plan
    backend.capture_metadata(2)
    targets = {call.target for call in standin.calls}
    expected = {"BatchDecodeWithPagedKVCacheWrapper.__init__",
                "BatchDecodeWithPagedKVCacheWrapper.plan", "BatchDecodeWithPagedKVCacheWrapper.run",
                "BatchPrefillWithPagedKVCacheWrapper.__init__"}
    if not batch_invariant:  # the mode never plans or runs the prefill wrapper
        expected |= {"BatchPrefillWithPagedKVCacheWrapper.plan",
                     "BatchPrefillWithPagedKVCacheWrapper.run"}
    assert targets == expected
    assert bind_all(real_flashinfer, standin.calls) == []
    # The kernels built ahead for the GPU check (benchmarks/gpukit/kernels.py) are fa2's.
    inits = [c for c in standin.calls if c.target.endswith(".__init__")]
    assert {c.kwargs.get("backend") for c in inits} == {"fa2"}


class LooksCuda(torch.Tensor):
    """A CPU tensor that answers is_cuda, so the ops take their FlashInfer branch."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_ops_calls_bind_to_the_pinned_flashinfer(monkeypatch, real_flashinfer, default_shape):
    """RMSNorm (rows and per-head), RoPE, SiLU-and-mul and both samplers, called the way the
    ops build the calls for the default model's shapes, on tensors that pass the ops' CUDA
    check (there is no GPU here; the stand-in computes on the CPU)."""
    from engine.layers.flashinfer_ops import FlashInferOps, top_k_top_p_sample
    from engine.models.llama import RotaryEmbedding

    standin = flashinfer_standin.install(monkeypatch)
    monkeypatch.setattr("engine.layers.flashinfer_ops.flashinfer_import_error", lambda: None)
    shape, tokens = default_shape, 5
    ops = FlashInferOps()

    def on_cuda(*size):
        return torch.randn(*size).to(torch.bfloat16).as_subclass(LooksCuda)

    ops.rms_norm(on_cuda(tokens, shape.hidden_size), torch.ones(shape.hidden_size), 1e-5)
    ops.rms_norm(on_cuda(tokens, shape.num_heads, shape.head_dim), torch.ones(shape.head_dim),
                 1e-5)
    rope = RotaryEmbedding(shape, 64, torch.bfloat16, CPU)
    ops.rope(rope, on_cuda(tokens, shape.num_heads, shape.head_dim),
             on_cuda(tokens, shape.num_kv_heads, shape.head_dim), torch.arange(tokens))
    ops.silu_and_mul(on_cuda(tokens, 2 * shape.intermediate_size))
    logits = on_cuda(3, shape.vocab_size).float()
    top_k_top_p_sample(logits, torch.tensor([20, 5, 1]), torch.tensor([0.9, 1.0, 0.5]))
    everything = torch.full((3,), shape.vocab_size)
    top_k_top_p_sample(logits, everything, torch.ones(3))

    assert [c.target for c in standin.calls] == [
        "rmsnorm", "rmsnorm", "apply_rope_with_cos_sin_cache", "silu_and_mul",
        "sampling.top_k_top_p_sampling_from_probs", "sampling.sampling_from_probs"]
    assert bind_all(real_flashinfer, standin.calls) == []


def test_a_renamed_keyword_fails_the_binding(real_flashinfer):
    """The check itself: a keyword the pinned plan() does not take is reported."""
    call = flashinfer_standin.Call("BatchDecodeWithPagedKVCacheWrapper.plan",
                                   (None,) * 7, {"disable_kv_split": True})
    (problem,) = bind_all(real_flashinfer, [call])
    assert "disable_kv_split" in problem


# ---------------------------------------------------------------- the batch-invariant mode


def build(default_shape, batch_invariant: bool) -> FlashInferAttentionBackend:
    return FlashInferAttentionBackend(
        2, 16, 16, default_shape.num_heads, default_shape.num_kv_heads, default_shape.head_dim,
        torch.bfloat16, CPU, batch_invariant=batch_invariant)


def decode_step(num_seqs: int):
    from tests.unit.test_flashinfer_metadata import chunk, seq

    return [chunk(seq(str(i), 20, [2 * i, 2 * i + 1]), 19, 1) for i in range(num_seqs)]


def test_batch_invariant_decodes_on_tensor_cores_without_split_kv(monkeypatch, default_shape):
    """9 query / 3 KV heads: a group of 3, which the CUDA-core kernel covers, so by default
    decode runs there; but that planner splits the KV sequence by the batch's size whatever
    disable_split_kv says, so the mode takes the tensor-core path and turns the split off."""
    standin = flashinfer_standin.install(monkeypatch)
    assert default_shape.num_heads // default_shape.num_kv_heads == 3
    default = build(default_shape, batch_invariant=False)
    assert default.decode_wrapper.use_tensor_cores is False
    invariant = build(default_shape, batch_invariant=True)
    assert invariant.decode_wrapper.use_tensor_cores is True
    for backend in (default, invariant):
        backend.prepare(decode_step(3))
    assert default.decode_wrapper.plan_kwargs.get("disable_split_kv", False) is False
    assert invariant.decode_wrapper.plan_kwargs["disable_split_kv"] is True
    # CUDA-graph decode wrappers (unused in the mode, but built alike).
    invariant.enable_decode_graphs([4], max_model_len=64)
    graph_wrapper = invariant.capture_metadata(4).decode.wrapper
    assert graph_wrapper.use_tensor_cores is True
    assert graph_wrapper.plan_kwargs["disable_split_kv"] is True
    inits = [c.kwargs["use_tensor_cores"] for c in standin.calls
             if c.target == "BatchDecodeWithPagedKVCacheWrapper.__init__"]
    assert inits == [False, True, True]


def test_batch_invariant_asks_the_version_not_the_signature(monkeypatch, default_shape):
    """From FlashInfer 0.6.15 on, the decode plan() is (*args, **kwargs): the mode must still
    start. Before 0.4.0 there is no disable_split_kv: it must refuse, naming 0.4.0."""
    standin = flashinfer_standin.install(monkeypatch, version="0.7.2")
    standin.BatchDecodeWithPagedKVCacheWrapper.plan.__signature__ = inspect.Signature([
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY),
        inspect.Parameter("deprecated_positional_args", inspect.Parameter.VAR_POSITIONAL),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    assert build(default_shape, batch_invariant=True).batch_invariant
    flashinfer_standin.install(monkeypatch, version="0.3.1")
    with pytest.raises(ValueError, match=r"FlashInfer 0\.4\.0 or newer.*this is 0\.3\.1"):
        build(default_shape, batch_invariant=True)
    assert build(default_shape, batch_invariant=False).batch_invariant is False


@pytest.mark.parametrize("text,numbers", [
    ("0.6.14", (0, 6, 14)), ("0.7.0rc1", (0, 7, 0)), ("0.4.0+cu130", (0, 4, 0)),
    ("1", (1,)), ("", ()), ("dev", ())])
def test_release_numbers(text, numbers):
    assert release(text) == numbers
