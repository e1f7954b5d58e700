"""Every family the registry serves beyond the Llama one (tests/unit/test_model_reference.py
has Llama, Qwen2, Qwen3): a tiny random-weight transformers model per family, saved with
save_pretrained, loaded by our config reader and loader, served by EngineCore (paged torch
attention, chunked prefill, batching, a prefix-cache hit) and compared with transformers'
greedy generate in float32, logits within float32 tolerance.

Sliding windows (8) are shorter than most prompts and generations, so a missing or
off-by-one window changes tokens; MoE models have 4-8 experts, top-2."""

import json
import os
import re
import shutil
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from engine.kernels.cpu_kernels import kernels
from engine.layers.cpu_ops import BLOCKS_ONLY_MAX_ROWS, CpuKernelOps
from engine.layers.gguf_weights import BLOCK_KINDS
from engine.models.registry import (
    build_model,
    load_model_config,
    load_quantized_weights,
    load_weights,
)
from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.protocol import EngineRequest, SamplingParams, pack_ids, unpack_ids
from tests.tiny_vlm import tiny_vlm_tokenizer
from tests.unit.engine_builders import greedy_tokens
from tests.unit.test_model_reference import STEPS, TINY, VOCAB, _run, make_reference

WINDOW = 8
CPU = torch.device("cpu")
_NO_THETA = {k: v for k, v in TINY.items() if k != "rope_theta"}
_FREQS = 8  # Phi-3's rotary frequencies: head_dim 16 (hidden 64 over 4 heads) / 2

CASES = {
    # Top-2 of 8, renormalised; layer 1 a plain dense MLP (mlp_only_layers).
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, mlp_only_layers=[1])),
    # Top-2 of 4 without renormalising, and the sigmoid-gated shared expert.
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
    # Top-2 of 4, and a Mistral-style window over every layer.
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    # SmolLM3: no rotary embedding in every 2nd layer, and a window on those layers.
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, dict(
        no_rope_layer_interval=2, use_sliding_window=True, sliding_window=WINDOW)),
    # Gemma (1): Llama's layout with (1 + w) norms, a scaled embedding and GeGLU.
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(head_dim=16)),
    # Alternating sliding / global layers, soft-capped scores and logits, a score scale
    # that is not head_dim ** -0.5.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0)),
    # Two rotary bases (the global one linearly scaled), q/k norms.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        _NO_THETA, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    # Fused qkv / gate_up in the checkpoint, LongRoPE (short factors below the original
    # length, with its attention factor).
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        _NO_THETA, original_max_position_embeddings=64, rope_parameters={
            "rope_type": "longrope", "rope_theta": 1000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(_FREQS)],
            "long_factor": [2.0 + 0.5 * i for i in range(_FREQS)],
            "original_max_position_embeddings": 64})),
    # Phi-4-mini: rotary over 3/4 of each head (12 of 16 dims), LongRoPE over those.
    "phi4_mini": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        _NO_THETA, original_max_position_embeddings=64, rope_parameters={
            "rope_type": "longrope", "rope_theta": 1000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(_FREQS * 3 // 4)],
            "long_factor": [2.0 + 0.5 * i for i in range(_FREQS * 3 // 4)],
            "original_max_position_embeddings": 64})),
    # Sinks, biases everywhere, alternating windows, YaRN, clamped SwiGLU experts.
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        _NO_THETA, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=WINDOW, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 32, "truncate": False})),
}
# Per case: (architecture, MoE experts or 0, windowed layers)
EXPECTED = {
    "qwen3_moe": ("qwen3_moe", 8, 0),
    "qwen2_moe": ("qwen2_moe", 4, 0),
    "mixtral": ("mixtral", 4, 3),
    "gemma": ("gemma", 0, 0),
    "smollm3": ("smollm3", 0, 1),
    "gemma2": ("gemma2", 0, 2),
    "gemma3": ("gemma3", 0, 2),
    "phi3": ("phi3", 0, 0),
    "phi4_mini": ("phi3", 0, 0),
    "gpt_oss": ("gpt_oss", 4, 2),
}
# Cases whose seed-8 weights have a greedy near-tie (top-2 gap under 1e-3) take another.
SEEDS = {"mixtral": 3}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(request, tmp_path_factory):
    case = request.param
    config_cls, model_cls, overrides = CASES[case]
    kwargs = {**TINY, **overrides}
    path = tmp_path_factory.mktemp(case)
    return case, make_reference(path, config_cls, model_cls, kwargs, SEEDS.get(case, 8))


def test_family_config_and_reference(reference):
    case, ref = reference
    config = load_model_config(ref.path)
    arch, experts, windowed = EXPECTED[case]
    assert config.architecture == arch
    assert (config.moe.num_experts if config.moe else 0) == experts
    windows = [config.attention_of(i).window for i in range(config.num_layers)]
    assert sum(w is not None for w in windows) == windowed
    assert all(w in (None, WINDOW) for w in windows)
    # Pages behind the window are released only where no layer attends the whole context.
    assert config.kv_window == (WINDOW if windowed == config.num_layers else None)
    # The reference is worth comparing against: no greedy near-ties, varied outputs, and
    # prompts and generations longer than the window.
    for logits in ref.step_logits:
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    assert len({tuple(seq) for seq in ref.tokens}) == len(ref.tokens)
    assert max(len(p) for p in ref.prompts) > WINDOW


# Alone with plain torch ops; all together in chunks of 8 with the compiled CPU kernels
# (where they build); then again on the warm engine with prefix-cache hits.
MODES = [("alone", False), ("together", True), ("prefix-cached", False)]


@pytest.mark.parametrize(("mode", "use_kernels"), MODES, ids=[m for m, _ in MODES])
def test_matches_transformers(reference, mode, use_kernels):
    _, ref = reference
    compiled = kernels() if use_kernels else None
    tokens, logits, num_steps = _run(ref.path, ref.prompts, mode, compiled)
    assert num_steps > STEPS  # chunked prefill: more steps than tokens
    for i, prompt in enumerate(ref.prompts):
        assert logits[i].shape == (STEPS, VOCAB), f"prompt {i}"
        torch.testing.assert_close(logits[i][0], ref.first_logits[i], atol=1e-4, rtol=0)
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i], f"prompt {i} (length {len(prompt)})"


# --- through the engine's own start: build_engine on the folder ----------------------------------


def _engine_config(path: str, **overrides) -> EngineConfig:
    fields = dict(num_pages=64, max_num_batched_tokens=8) | overrides
    return EngineConfig(model=path, served_model_name="m", request_address="inproc://x",
                        device="cpu", dtype="float32", attention_backend="torch", **fields)


def test_served_by_build_engine(reference):
    """`sluice serve DIR`'s engine: the registry's model, the backend told each layer's
    attention, the default ops; all prompts at once, chunked."""
    _, ref = reference
    tiny_vlm_tokenizer().save_pretrained(ref.path)  # a byte-level one, as llguidance needs
    core = build_engine(_engine_config(ref.path, threads=1))
    assert greedy_tokens(core, ref.prompts, STEPS) == ref.tokens


def test_windowed_model_releases_pages_behind_the_window(tmp_path):
    """A Mistral-style model windowed in every layer, served by build_engine with 5 pages of
    4 tokens: a 27-token prompt and 72 generated tokens (25 pages' worth) fit because the
    pages behind the window go back, each step holding at most the pages its keys need;
    greedy tokens still equal transformers' (whose eager attention masks the window)."""
    from tests.unit.test_model_reference import _prompts, _randomize

    kwargs = {**TINY, "sliding_window": WINDOW}
    model = transformers.MistralForCausalLM._from_config(
        transformers.MistralConfig(**kwargs), attn_implementation="eager").float().eval()
    _randomize(model, seed=8)
    model.save_pretrained(tmp_path)
    tiny_vlm_tokenizer().save_pretrained(tmp_path)
    prompt, steps = _prompts(seed=7)[-1], 72
    with torch.no_grad():
        ids = torch.tensor([prompt])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=steps, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    # A chunk of 8 after the window's 7 keys, from anywhere in a page: 18 tokens, 5 pages.
    from shared.startup_checks import StartupError

    with pytest.raises(StartupError, match=r"KV cache \(4 pages of 4 tokens\)"):
        build_engine(_engine_config(str(tmp_path), threads=1, page_size=4, num_pages=4))
    core = build_engine(_engine_config(str(tmp_path), threads=1, page_size=4, num_pages=5))
    assert core.scheduler.kv_window == WINDOW
    core.add(EngineRequest(
        request_id="r", prompt_token_ids=pack_ids(prompt), reply_to="tcp://test",
        params=SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True),
        arrival_time=0.0))
    tokens, held = [], []
    while core.has_work:
        for _, out in core.step():
            assert out.error is None, out.error
            tokens.extend(unpack_ids(out.new_token_ids).tolist())
        held += [len(s.pages) - s.num_released_pages for s in core.scheduler.running]
    assert tokens == expected
    # window - 1 keys before a chunk of at most 8 tokens, one page of rounding: 5 pages.
    assert max(held) <= 5 and core.allocator.num_free == 5


def _rss_anon() -> int:
    """This process's private resident bytes (file-backed pages, as a mapped checkpoint's,
    are counted apart by the kernel), after handing glibc's free heap pages back, so that
    memory freed earlier and reused does not hide a growth."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@pytest.mark.slow  # 64 experts a layer, built twice: 3 to 6 s each
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's RssAnon")
@pytest.mark.parametrize(("case", "pairs"), [("qwen3_moe", False), ("mixtral", True)])
def test_experts_stay_in_the_mapped_checkpoint(tmp_path, case, pairs):
    """64 experts a layer (36 MiB of float32 experts): loaded and built into the model, they
    stay views of the memory-mapped safetensors file, so private memory grows by far less
    than their bytes; copied (no mapping), it grows by at least their bytes. Qwen-MoE's
    gate_proj and up_proj lie back to back in the file (one weight viewing both); Mixtral's
    w1 and w3 do not (kept as a pair)."""
    from engine.layers.safetensors_weights import in_mapped_file
    from engine.models.registry import build_model, expected_shapes, load_weights

    config_cls, _, overrides = CASES[case]
    experts = {"num_experts": 64} if case == "qwen3_moe" else {"num_local_experts": 64}
    inter = {"moe_intermediate_size": 128} if case == "qwen3_moe" else {}
    hf = config_cls(**{**TINY, **overrides, **experts, **inter, "hidden_size": 128,
                       "intermediate_size": 128, "mlp_only_layers": []})
    hf.save_pretrained(tmp_path)
    config = load_model_config(str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) * 0.05
               for name, shape in expected_shapes(config).items()}
    expert_bytes = sum(t.nbytes for name, t in tensors.items() if ".experts." in name)
    assert expert_bytes == 3 * 64 * 3 * 128 * 128 * 4
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    del tensors

    def grown(mapped: bool):
        before = _rss_anon()
        weights = load_weights(str(tmp_path), config, torch.float32,
                               map_experts_as=torch.float32 if mapped else None)
        model = build_model(config, weights, 64, torch.float32, CPU)
        del weights
        return _rss_anon() - before, model

    growth, model = grown(mapped=True)
    gate_up = model.layers[0].moe.gate_up.weights
    assert all(isinstance(w, tuple) == pairs for w in gate_up)
    assert all(in_mapped_file(t) for w in gate_up for t in (w if pairs else (w,)))
    assert growth < expert_bytes / 4, (growth, expert_bytes)
    del model, gate_up
    growth, _ = grown(mapped=False)
    assert growth >= expert_bytes / 2, (growth, expert_bytes)


def test_moe_block_paths_agree(monkeypatch):
    """One MoE MLP four ways: grouped by expert (as served on CPU), with each expert's gate
    and up kept as a pair (Mixtral's mapped experts), as one grouped GEMM per projection
    over stacked experts (as served on CUDA in bfloat16; F.grouped_mm runs on CPU too), and
    token by token (the reference that SLUICE_MOE_PER_TOKEN=1 switches on for
    benchmarks/moe_serve.py): the same output."""
    from engine.layers.config import MoeConfig
    from engine.layers.torch_ops import TorchOps
    from engine.models.moe import ExpertLinear, MoeBlock

    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    config = MoeConfig(num_experts=8, top_k=2, intermediate_size=16, norm_topk_prob=True)
    gates, ups = [rand(16, 32) for _ in range(8)], [rand(16, 32) for _ in range(8)]
    downs, router = [rand(32, 16) for _ in range(8)], rand(8, 32)
    fused = ExpertLinear([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])
    grouped = MoeBlock(config, router, None, fused, ExpertLinear(downs))
    pairs = MoeBlock(config, router, None, ExpertLinear(list(zip(gates, ups, strict=True))),
                     ExpertLinear(downs))
    monkeypatch.setenv("SLUICE_MOE_PER_TOKEN", "1")
    naive = MoeBlock(config, router, None, fused, ExpertLinear(downs))
    assert naive.per_token and not grouped.per_token
    x, ops = torch.randn(13, 32, generator=gen), TorchOps()
    out = grouped(x, ops)
    torch.testing.assert_close(pairs(x, ops), out)
    torch.testing.assert_close(naive(x, ops), out)
    stacked = MoeBlock(config, router, None, fused, ExpertLinear(downs))
    assert stacked.stacks is None  # CPU tensors: the loop serves
    stacked.stack_experts()
    assert stacked.gate_up.weights[3].data_ptr() == stacked.stacks.gate_up[3].data_ptr()
    torch.testing.assert_close(stacked.grouped_gemm_experts(x, *grouped.route(x), ops), out)
    # Experts with biases (gpt-oss's) and a batch that leaves experts without rows.
    biased = MoeBlock(config, router, None, ExpertLinear(fused.weights, [rand(32) for _ in
                      range(8)]), ExpertLinear(downs, [rand(32) for _ in range(8)]))
    want = biased(x[:2], ops)
    biased.stack_experts()
    routed = biased.route(x[:2])
    assert len(routed[0].unique()) < 8
    torch.testing.assert_close(biased.grouped_gemm_experts(x[:2], *routed, ops), want)
    assert not torch.allclose(want, grouped(x[:2], ops))  # the biases count


# --- bad checkpoints stop the engine at start, naming the key or tensor ---------------------------


def _save_tiny(path, config_cls, model_cls, **overrides) -> str:
    model = model_cls._from_config(config_cls(**{**TINY, **overrides}))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return _save_tiny(tmp_path_factory.mktemp("moe"), transformers.Qwen3MoeConfig,
                      transformers.Qwen3MoeForCausalLM, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, num_hidden_layers=1)


def _rewrite_tensors(folder: str, edit) -> None:
    file = os.path.join(folder, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _rewrite_config(folder: str, **fields) -> None:
    file = os.path.join(folder, "config.json")
    with open(file) as f:
        config = json.load(f)
    with open(file, "w") as f:
        json.dump(config | fields, f)


def _refused(folder: str, match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        build_engine(_engine_config(folder))


def test_missing_expert_refused(tiny_moe, tmp_path):
    folder = str(shutil.copytree(tiny_moe, tmp_path / "m"))
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    _rewrite_tensors(folder, lambda t: t.pop(name))
    _refused(folder, re.escape(name))


def test_misshapen_router_refused(tiny_moe, tmp_path):
    folder = str(shutil.copytree(tiny_moe, tmp_path / "m"))
    name = "model.layers.0.mlp.gate.weight"
    _rewrite_tensors(folder, lambda t: t.update({name: t[name][:3]}))  # 3 experts, not 4
    _refused(folder, re.escape(name) + r" has shape \(3, 64\), expected \(4, 64\)")


@pytest.mark.parametrize(("fields", "match"), [
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"},
     "unsupported model.*FalconForCausalLM.*supported architectures: .*Qwen3MoeForCausalLM"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok: 5 is not within 1..4"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok: 0 is not within 1..4"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_moe_config_refused(tiny_moe, tmp_path, fields, match):
    folder = str(shutil.copytree(tiny_moe, tmp_path / "m"))
    _rewrite_config(folder, **fields)
    _refused(folder, match)


@pytest.mark.parametrize(("fields", "match"), [
    ({"hidden_act": "silu"}, "hidden_act: 'silu' is not implemented"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"head_dim": "16"}, "head_dim"),
])
def test_bad_gemma_config_refused(tmp_path, fields, match):
    """Gemma (1): what it does not compute, named; transformers' legacy "gelu" and a
    missing hidden_act both read as the tanh GELU it uses."""
    folder = _save_tiny(tmp_path / "g", transformers.GemmaConfig,
                        transformers.GemmaForCausalLM, head_dim=16, num_hidden_layers=1)
    _rewrite_config(folder, hidden_act="gelu")
    assert load_model_config(folder).architecture == "gemma"
    file = os.path.join(folder, "config.json")
    with open(file) as f:
        config = json.load(f)
    with open(file, "w") as f:
        json.dump({k: v for k, v in config.items() if k != "hidden_act"}, f)
    assert load_model_config(folder).architecture == "gemma"
    _rewrite_config(folder, **fields)
    _refused(folder, match)


@pytest.mark.parametrize(("fields", "match"), [
    ({"no_rope_layers": [1, 0]}, "no_rope_layers: needs one 0 or 1 per layer"),
    ({"no_rope_layers": [1, 2, 1, 1]}, "no_rope_layers: needs one 0 or 1 per layer"),
    ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval: 0"),
    ({"use_sliding_window": True, "sliding_window": 0, "layer_types": [
        "full_attention", "full_attention", "full_attention", "sliding_attention"]},
     "sliding_window: 0 is not a window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_bad_smollm3_config_refused(tmp_path, fields, match):
    folder = _save_tiny(tmp_path / "s", transformers.SmolLM3Config,
                        transformers.SmolLM3ForCausalLM, num_hidden_layers=4)
    assert load_model_config(folder).nope_layers == (3,)  # the default: every 4th layer
    _rewrite_config(folder, **fields)
    _refused(folder, match)


@pytest.mark.parametrize(("window", "ok"), [(0, False), (1, True), (128, True), (129, False)])
def test_window_must_lie_within_the_context(tmp_path, window, ok):
    """Gemma 2's sliding_window: 1..max_position_embeddings (128 here)."""
    folder = _save_tiny(tmp_path / "g", transformers.Gemma2Config,
                        transformers.Gemma2ForCausalLM, head_dim=16, num_hidden_layers=2,
                        sliding_window=8)
    _rewrite_config(folder, sliding_window=window)
    if ok:
        assert load_model_config(folder).attention_of(0).window == window
    else:
        _refused(folder, rf"sliding_window: {window} is not a window within the context "
                         r"\(1\.\.128\)")


@pytest.mark.parametrize(("factor", "rotary_dim"), [
    (1.0, None), (0.5, 8), (0.75, 12), (0.3, 4), (0.0, "refused"), (1.5, "refused"),
    (0.1, "refused"), ("half", "refused")])
def test_partial_rotary_factor_bounds(tmp_path, factor, rotary_dim):
    """partial_rotary_factor (top level, as Phi-4-mini's config.json writes it) rotates an
    even number of each head's 16 dims, more than none and at most all; int() truncates as
    transformers does (0.3: 4 dims; 0.1: 1, odd)."""
    folder = _save_tiny(tmp_path / "p", transformers.Phi3Config, transformers.Phi3ForCausalLM,
                        num_hidden_layers=1)
    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    raw.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    raw["partial_rotary_factor"] = factor
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(raw, f)
    if rotary_dim == "refused":
        with pytest.raises((ValueError, TypeError), match="partial_rotary_factor"):
            load_model_config(folder)
    else:
        assert load_model_config(folder).rotary_dim == rotary_dim


# --- pieces the engine-level comparisons cannot reach ------------------------------------------


def test_longrope_uses_long_factors_past_the_original_length():
    """Positions at or past original_max_position_embeddings rotate with the long factors:
    the cos/sin transformers computes for a sequence longer than the original length."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from engine.layers.rotary import RotaryEmbedding

    original, length = 16, 40
    rope = {"rope_type": "longrope", "rope_theta": 1000.0, "original_max_position_embeddings":
            original, "short_factor": [1.0 + 0.1 * i for i in range(_FREQS)],
            "long_factor": [2.0 + 0.5 * i for i in range(_FREQS)]}
    hf_config = transformers.Phi3Config(**{**_NO_THETA, "max_position_embeddings": 64,
                                           "original_max_position_embeddings": original,
                                           "rope_parameters": rope})
    path = tempfile.mkdtemp()
    hf_config.save_pretrained(path)
    ours = RotaryEmbedding(load_model_config(path), 64, torch.float32, CPU)
    x = torch.zeros(1, length, 16)
    cos, sin = Phi3RotaryEmbedding(hf_config)(x, torch.arange(length)[None])
    past = slice(original, length)
    torch.testing.assert_close(ours.cos[past], cos[0, past], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.sin[past], sin[0, past], atol=1e-5, rtol=0)


def test_flashinfer_refuses_mixed_layers_at_start(tmp_path):
    """One FlashInfer plan serves every layer: Gemma's sliding + global mix is refused
    before any flashinfer import, naming the backend that serves it."""
    from engine.attention.selector import create_attention_backend

    folder = _save_tiny(tmp_path / "g", transformers.Gemma2Config,
                        transformers.Gemma2ForCausalLM, head_dim=16, num_hidden_layers=2,
                        sliding_window=8)
    with pytest.raises(ValueError, match="--attention-backend torch"):
        create_attention_backend("flashinfer", load_model_config(folder), 8, 4,
                                 torch.bfloat16, torch.device("cuda"))


def test_gpt_oss_mxfp4_experts(tmp_path):
    """The published gpt-oss checkpoints' MXFP4 experts (blocks + scales; kept packed by
    the kernels: tests/unit/test_mxfp4.py) give the same tokens and logits as transformers
    running the dense weights its own MXFP4 converter makes of those blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(3)
    packed = {}

    def quantize_experts(model):
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                for name, param in (("gate_up_proj", layer.mlp.experts.gate_up_proj),
                                    ("down_proj", layer.mlp.experts.down_proj)):
                    experts, width, rows = param.shape  # dense layout: [E, in, out]
                    blocks = torch.randint(0, 256, (experts, rows, width // 32, 16),
                                           generator=gen, dtype=torch.uint8)
                    # 2 ** -5..-3 times FP4 values up to 6: weights around width ** -0.5
                    scales = torch.randint(122, 125, (experts, rows, width // 32),
                                           generator=gen, dtype=torch.uint8)
                    param.copy_(convert_moe_packed_tensors(blocks, scales,
                                                           dtype=torch.float32))
                    packed[f"model.layers.{i}.mlp.experts.{name}"] = (blocks, scales)

    config_cls, model_cls, overrides = CASES["gpt_oss"]
    ref = make_reference(tmp_path, config_cls, model_cls, {**TINY, **overrides}, seed=8,
                         prepare=quantize_experts)

    def swap_in_blocks(tensors):
        for name, (blocks, scales) in packed.items():
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales

    _rewrite_tensors(ref.path, swap_in_blocks)
    _rewrite_config(ref.path, quantization_config={"quant_method": "mxfp4"})
    assert load_model_config(ref.path).family_options.mxfp4
    tokens, logits, _ = _run(ref.path, ref.prompts, "together", kernels())
    for i in range(len(ref.prompts)):
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i]


# llama.cpp's tensor names (convert_hf_to_gguf.py), written out here rather than taken from
# the loader, so a wrong mapping in the loader cannot pass by writing the same wrong file.
_LLAMACPP_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def _llama_cpp_rope_freqs(hf) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs for llama3 scaling: each frequency's
    divisor (1 above the high band, `factor` below the low one, smoothed between)."""
    import math

    rope, dim = hf.rope_parameters, hf.hidden_size // hf.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    divisors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32)


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows to ggml's pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_gguf(folder: str, path: str, hf, arch: str, experts_as=None) -> None:
    """What convert_hf_to_gguf.py writes for these checkpoints, in float32: MoE experts
    stacked into one tensor per projection (quantized to experts_as, a GGMLQuantizationType,
    if given); a Llama's q/k rows permuted to ggml's rope layout and its llama3 scaling as
    the rope_freqs divisors."""
    import gguf

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if getattr(hf, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(hf.shared_expert_intermediate_size)
    writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    if getattr(hf, "num_experts", 0):
        writer.add_expert_count(hf.num_experts)
        writer.add_expert_used_count(hf.num_experts_per_tok)
        writer.add_expert_feed_forward_length(hf.moe_intermediate_size)
    if arch == "llama" and hf.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(hf).numpy())
    writer.add_tensor("token_embd.weight", tensors.pop("model.embed_tokens.weight").numpy())
    writer.add_tensor("output_norm.weight", tensors.pop("model.norm.weight").numpy())
    if "lm_head.weight" in tensors:
        writer.add_tensor("output.weight", tensors.pop("lm_head.weight").numpy())
    for i in range(hf.num_hidden_layers):
        prefix = f"model.layers.{i}."
        if arch == "llama":
            for proj, heads in (("q_proj", hf.num_attention_heads),
                                ("k_proj", hf.num_key_value_heads)):
                name = f"{prefix}self_attn.{proj}.weight"
                tensors[name] = _llama_cpp_permute(tensors[name], heads)
        for proj, stacked in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                              ("down_proj", "ffn_down_exps")):
            names = [f"{prefix}mlp.experts.{e}.{proj}.weight"
                     for e in range(getattr(hf, "num_experts", 0))]
            if names and names[0] in tensors:
                experts = torch.stack([tensors.pop(n) for n in names]).numpy()
                if experts_as is None:
                    writer.add_tensor(f"blk.{i}.{stacked}.weight", experts)
                else:
                    writer.add_tensor(f"blk.{i}.{stacked}.weight",
                                      gguf.quants.quantize(experts, experts_as),
                                      raw_dtype=experts_as)
        for hf_name, gguf_name in _LLAMACPP_LAYER.items():
            if prefix + hf_name in tensors:
                writer.add_tensor(f"blk.{i}.{gguf_name}", tensors.pop(prefix + hf_name).numpy())
    assert not tensors, f"not written: {sorted(tensors)}"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("case", "arch", "dense_layers"),
                         [("qwen3_moe", "qwen3moe", (1,)), ("qwen2_moe", "qwen2moe", ())])
def test_moe_gguf(tmp_path, case, arch, dense_layers):
    """A GGUF written from the MoE checkpoint (llama.cpp's layout for it) serves the same
    tokens and logits as transformers on the checkpoint; Qwen3-MoE's layer 1 is dense."""
    config_cls, model_cls, overrides = CASES[case]
    kwargs = {**TINY, **overrides}
    ref = make_reference(tmp_path / "hf", config_cls, model_cls, kwargs, seed=8)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(ref.path, path, config_cls(**kwargs), arch)
    config = load_model_config(path)
    assert config.architecture == case and config.moe.dense_layers == dense_layers
    tokens, logits, _ = _run(path, ref.prompts, "together", kernels())
    for i in range(len(ref.prompts)):
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i]


@pytest.mark.parametrize(("case", "arch"), [("qwen3_moe", "qwen3moe"), ("qwen2_moe", "qwen2moe")])
def test_moe_gguf_experts_multiply_as_blocks(tmp_path, case, arch):
    """A GGUF whose stacked experts are Q8_0, loaded as build_engine loads it on CPU: each
    expert is only its blocks (a meta tensor stands for the weight: no dequantized copy),
    multiplied by the kernel up to BLOCKS_ONLY_MAX_ROWS rows and past it by F.linear over
    that expert dequantized for the call (the dense load's very weights, so the same bits).
    Greedy tokens, and logits within float32 summation order, are the same file's loaded
    dequantized on plain torch, in chunks of 8 and in one prefill of every prompt (many
    rows an expert)."""
    import gguf

    compiled = kernels()
    if compiled is None:
        pytest.skip("no C++ compiler: the engine runs plain torch ops")
    config_cls, model_cls, overrides = CASES[case]
    kwargs = {**TINY, **overrides}
    ref = make_reference(tmp_path / "hf", config_cls, model_cls, kwargs, seed=8)
    path = str(tmp_path / f"tiny-{arch}-q8.gguf")
    _write_gguf(ref.path, path, config_cls(**kwargs), arch, gguf.GGMLQuantizationType.Q8_0)
    config = load_model_config(path)
    quantized = load_quantized_weights(path, config)
    ops = CpuKernelOps(compiled)
    assert ops.multiplies_blocks(torch.float32)
    weights = load_weights(path, config, torch.float32, experts_as_blocks=torch.float32)
    dense = load_weights(path, config, torch.float32)  # the reference: dequantized
    model = build_model(config, weights, 64, torch.float32, CPU, ops=ops, quantized=quantized)
    layer = next(i for i, layer in enumerate(model.layers) if layer.moe is not None)
    moe = model.layers[layer].moe
    x = torch.randn(BLOCKS_ONLY_MAX_ROWS + 24, config.hidden_size,
                    generator=torch.Generator().manual_seed(0))
    for e in range(config.moe.num_experts):
        p = f"model.layers.{layer}.mlp.experts.{e}."
        q = quantized[p + "down_proj.weight"]
        assert q.kind == BLOCK_KINDS["Q8_0"] and q.blocks.dtype == torch.uint8
        want = {id(moe.gate_up.weights[e]): torch.cat([dense[p + "gate_proj.weight"],
                                                       dense[p + "up_proj.weight"]]),
                id(moe.down.weights[e]): dense[p + "down_proj.weight"]}
        for weight in (moe.gate_up.weights[e], moe.down.weights[e]):
            assert weight.is_meta  # no bytes: the loader kept no dequantized copy
            blocks = ops._quantized[id(weight)]
            few = x[:BLOCKS_ONLY_MAX_ROWS, : weight.shape[1]].contiguous()
            assert torch.equal(ops.linear(few, weight),
                               compiled.quantized_linear(few, blocks.blocks, blocks.kind))
            many = x[:, : weight.shape[1]]
            assert torch.equal(ops.linear(many, weight), F.linear(many, want[id(weight)]))
    for mode in ("together", "single-chunk"):
        tokens, logits, _ = _run(path, ref.prompts, mode, compiled, quantized=True)
        want_tokens, want_logits, _ = _run(path, ref.prompts, mode)
        assert tokens == want_tokens, mode
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_llama3_gguf_reads_rope_freqs(tmp_path):
    """A Llama 3.x GGUF: llama.cpp stores its llama3 rope scaling only as the rope_freqs
    divisors. Read as they are, they give transformers' tokens and logits on the checkpoint
    the file was written from."""
    rope = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    kwargs = {**_NO_THETA, "rope_parameters": rope}
    ref = make_reference(tmp_path / "hf", transformers.LlamaConfig,
                         transformers.LlamaForCausalLM, kwargs, seed=8)
    path = str(tmp_path / "tiny-llama3.gguf")
    _write_gguf(ref.path, path, transformers.LlamaConfig(**kwargs), "llama")
    scaling = load_model_config(path).rope_scaling
    assert scaling.rope_type == "freq_factors" and len(set(scaling.freq_factors)) > 2
    tokens, logits, _ = _run(path, ref.prompts, "together", kernels())
    for i in range(len(ref.prompts)):
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i]


def _write_mapped_gguf(folder: str, path: str, arch, layers: int, metadata, shift_norms=False,
                       extra_tensors=()) -> None:
    """A GGUF of the checkpoint under llama.cpp's own tensor names (gguf's TensorNameMap,
    not our loader's), float32; Gemma's norms stored as 1 + w, as convert_hf_to_gguf.py
    writes them. metadata(writer) adds the architecture's keys."""
    import gguf

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    metadata(writer)
    for name, tensor in sorted(tensors.items()):
        mapped = names.get_name(name.removesuffix(".weight"))
        assert mapped is not None, name
        if shift_norms and name.endswith("norm.weight"):
            tensor = tensor + 1
        writer.add_tensor(f"{mapped}.weight", tensor.numpy())
    for gguf_name, tensor in extra_tensors:  # already in llama.cpp's names
        writer.add_tensor(f"{gguf_name}.weight", tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _common_metadata(writer, hf, head_dim: int) -> None:
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def _gemma_gguf_metadata(case: str, hf):
    import gguf

    def metadata(writer) -> None:
        _common_metadata(writer, hf, hf.head_dim)
        if case == "gemma":  # no windows, one rotary base
            writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
            return
        writer.add_sliding_window(hf.sliding_window)
        # Which layers are windowed: the real models' every-2nd / every-6th global layer is
        # the reader's default; three layers need the explicit form.
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in hf.layer_types])
        if case == "gemma2":
            writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
            writer.add_attn_logit_softcapping(hf.attn_logit_softcapping)
            writer.add_final_logit_softcapping(hf.final_logit_softcapping)
        else:  # the global layers' rotary base and scaling; the sliding ones' base
            full = hf.rope_parameters["full_attention"]
            writer.add_rope_freq_base(full["rope_theta"])
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
            writer.add_rope_freq_base_swa(hf.rope_parameters["sliding_attention"]["rope_theta"])
    return metadata


def _phi3_gguf_metadata(hf):
    def metadata(writer) -> None:
        import math

        rope = hf.rope_parameters
        _common_metadata(writer, hf, hf.hidden_size // hf.num_attention_heads)
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0)
                                            * hf.hidden_size) // hf.num_attention_heads)
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = hf.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_sliding_window(0)
    return metadata


@pytest.mark.parametrize("case", ["gemma", "gemma2", "gemma3", "phi3", "phi4_mini"])
def test_llama_cpp_gguf_of_the_family(tmp_path, case):
    """The file convert_hf_to_gguf.py writes for the checkpoint (llama.cpp's names, Gemma's
    norms as 1 + w, Phi-3's fused projections and LongRoPE factor tensors, Phi-4-mini's
    rotary width) serves transformers' tokens and logits. Gemma's score scale is
    1 / sqrt(head_dim) here: llama.cpp's files do not store query_pre_attn_scalar."""
    import gguf

    config_cls, model_cls, overrides = CASES[case]
    if case.startswith("gemma"):
        overrides = {**overrides, "query_pre_attn_scalar": overrides["head_dim"]}
    kwargs = {**TINY, **overrides}
    ref = make_reference(tmp_path / "hf", config_cls, model_cls, kwargs, seed=8)
    hf = config_cls(**kwargs)
    path = str(tmp_path / f"tiny-{case}.gguf")
    if case.startswith("gemma"):
        arch = {"gemma": gguf.MODEL_ARCH.GEMMA, "gemma2": gguf.MODEL_ARCH.GEMMA2}.get(
            case, gguf.MODEL_ARCH.GEMMA3)
        _write_mapped_gguf(ref.path, path, arch, hf.num_hidden_layers,
                           _gemma_gguf_metadata(case, hf), shift_norms=True)
    else:
        rope = hf.rope_parameters
        factors = [(f"rope_factors_{kind}", torch.tensor(rope[f"{kind}_factor"]))
                   for kind in ("long", "short")]
        _write_mapped_gguf(ref.path, path, gguf.MODEL_ARCH.PHI3, hf.num_hidden_layers,
                           _phi3_gguf_metadata(hf), extra_tensors=factors)
    config = load_model_config(path)
    assert config.architecture == EXPECTED[case][0]
    tokens, logits, _ = _run(path, ref.prompts, "together", kernels())
    for i in range(len(ref.prompts)):
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i]


def test_gpt_oss_gguf(tmp_path):
    """The file convert_hf_to_gguf.py writes for a gpt-oss checkpoint (general.architecture
    "gpt-oss"; gate_up split into gate and up experts [E, out, in], stored as MXFP4 blocks;
    sinks, router and expert biases under llama.cpp's names; YaRN in the metadata) serves
    transformers' tokens and logits. The checkpoint's experts are first rounded to values
    MXFP4 holds exactly, so the file's blocks are the checkpoint itself."""
    import gguf

    mxfp4 = gguf.GGMLQuantizationType.MXFP4

    def round_experts(model):  # through MXFP4 along each row's input dimension, as stored
        with torch.no_grad():
            for layer in model.model.layers:
                for param in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    rows = param.transpose(1, 2).numpy()  # [E, out, in]
                    exact = gguf.quants.dequantize(gguf.quants.quantize(rows, mxfp4), mxfp4)
                    param.copy_(torch.from_numpy(exact).transpose(1, 2))

    config_cls, model_cls, overrides = CASES["gpt_oss"]
    kwargs = {**TINY, **overrides}
    ref = make_reference(tmp_path / "hf", config_cls, model_cls, kwargs, seed=8,
                         prepare=round_experts)
    hf = config_cls(**kwargs)
    rope = hf.rope_parameters
    path = str(tmp_path / "tiny-gpt-oss.gguf")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, hf.num_hidden_layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    _common_metadata(writer, hf, hf.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_expert_count(hf.num_local_experts)
    writer.add_expert_used_count(hf.num_experts_per_tok)
    writer.add_expert_feed_forward_length(hf.intermediate_size)
    writer.add_sliding_window(hf.sliding_window)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    def add(hf_name: str, suffix: str, tensor: torch.Tensor, quantize=False) -> None:
        mapped = names.get_name(hf_name)
        assert mapped is not None, hf_name
        array = tensor.contiguous().numpy()
        if quantize:
            writer.add_tensor(f"{mapped}.{suffix}", gguf.quants.quantize(array, mxfp4),
                              raw_dtype=mxfp4)
        else:
            writer.add_tensor(f"{mapped}.{suffix}", array)

    for name, tensor in sorted(load_file(os.path.join(ref.path, "model.safetensors")).items()):
        stem, _, suffix = name.rpartition(".")
        if name.endswith("sinks"):
            add(name, "weight", tensor)
        elif "gate_up_proj" in name:  # columns interleave gate and up
            stem = stem if name.endswith("_proj") else name.removesuffix("_bias")
            stem = stem.replace(".gate_up_proj", "")
            if name.endswith("_bias"):
                add(stem + ".gate_proj", "bias", tensor[..., 0::2])
                add(stem + ".up_proj", "bias", tensor[..., 1::2])
            else:
                rows = tensor.transpose(1, 2)  # [E, 2 * inter, hidden]
                add(stem + ".gate_proj", "weight", rows[:, 0::2], quantize=True)
                add(stem + ".up_proj", "weight", rows[:, 1::2], quantize=True)
        elif name.endswith("down_proj_bias"):
            add(name.removesuffix("_bias"), "bias", tensor)
        elif name.endswith("down_proj"):
            add(name, "weight", tensor.transpose(1, 2), quantize=True)
        else:
            add(stem, suffix, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = load_model_config(path)
    assert config.architecture == "gpt_oss" and config.moe.num_experts == 4
    assert [config.attention_of(i).window for i in range(3)] == [WINDOW, None, WINDOW]
    assert config.rope_scaling.rope_type == "yarn" and not config.rope_scaling.truncate
    tokens, logits, _ = _run(path, ref.prompts, "together", kernels())
    for i in range(len(ref.prompts)):
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i]
    if kernels() is None:
        return
    # On CPU with the kernels the MXFP4 experts are held as their blocks alone (meta
    # weights), multiplied by the kernel or dequantized per call past the row cut: the
    # same tokens, in chunks of 8 rows and in one prefill of every prompt.
    weights = load_weights(path, config, torch.float32, experts_as_blocks=torch.float32)
    assert weights["model.layers.0.mlp.experts.gate_up_proj"].is_meta
    assert not weights["model.layers.0.mlp.experts.gate_up_proj_bias"].is_meta
    for mode in ("together", "single-chunk"):
        tokens, logits, _ = _run(path, ref.prompts, mode, kernels(), quantized=True)
        for i in range(len(ref.prompts)):
            torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
            assert tokens[i] == ref.tokens[i], mode


@pytest.mark.parametrize(("arch", "layers", "globals_", "scalar"), [
    ("gemma2", 4, {1, 3}, 16), ("gemma3", 12, {5, 11}, 16),
    ("gemma2", 46, set(range(1, 46, 2)), 64 / 4), ("gemma3", 62, set(range(5, 62, 6)), 64 / 4)])
def test_gemma_gguf_layers_as_llama_cpp_reads_them(tmp_path, arch, layers, globals_, scalar):
    """Without a stated pattern, every 2nd (Gemma 2) or 6th (Gemma 3) layer is global; the
    score scale is 1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 27B models, told
    by their layer count (46, 62) as llama.cpp tells them."""
    import gguf

    path = str(tmp_path / "meta.gguf")
    writer = gguf.GGUFWriter(path, arch)
    for add, value in ((writer.add_context_length, 128), (writer.add_embedding_length, 64),
                       (writer.add_feed_forward_length, 32), (writer.add_block_count, layers),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
                       (writer.add_key_length, 16), (writer.add_value_length, 16),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_sliding_window, 8)):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = load_model_config(path)
    attention = [config.attention_of(i) for i in range(layers)]
    assert {i for i, a in enumerate(attention) if a.window is None} == globals_
    assert {a.window for a in attention if a.window is not None} == {8}
    assert {a.scale for a in attention} == {scalar**-0.5}


def test_mixtral_gguf_refused(tmp_path):
    """llama.cpp writes Mixtral as a "llama" GGUF with experts: refused, not misread as a
    dense Llama."""
    import gguf

    path = str(tmp_path / "mixtral.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_expert_count(4)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama.expert_count"):
        load_model_config(path)


@pytest.mark.parametrize(("window", "expected"), [
    (262144, None),  # Phi-3-mini-128k's: past the context, it never engages
    (128, None),  # as long as the context (128): none either
    (127, 127), (1, 1),
    (0, "refused"), (-4, "refused"),
])
def test_whole_model_window(tmp_path, window, expected):
    """Phi-3 (as Mistral and Mixtral) windows every layer where its config sets a window."""
    folder = _save_tiny(tmp_path / "p", transformers.Phi3Config,
                        transformers.Phi3ForCausalLM, num_hidden_layers=1, pad_token_id=None,
                        eos_token_id=None, bos_token_id=None)
    _rewrite_config(folder, sliding_window=window)
    if expected == "refused":
        with pytest.raises(ValueError, match=rf"sliding_window: {window} is not a positive"):
            load_model_config(folder)
    else:
        assert load_model_config(folder).attention_of(0).window == expected
