"""DeepSeek-V3 (and V2): multi-head latent attention over a paged latent cache, and
DeepSeekMoE routing, against transformers in float32 on tiny random checkpoints built
offline from DeepseekV3Config / DeepseekV2Config.

V3's case: low-rank q, YaRN with mscale_all_dim (a score scale that is not
qk_head_dim ** -0.5), interleaved rotary pairs, 8 experts in 4 groups of which 2 are kept
(sigmoid scores), one shared expert, the first layer dense. V2's: one q_proj, softmax
scores with group_limited_greedy, two shared experts. Served by EngineCore over the latent
cache: each prompt alone (chunked prefill, pages of 4 under a budget of 8), all together
(batched decode beside prefill chunks), whole (one chunk each), and again on a warm engine
(prefix-cache hits)."""

import msgspec
import pytest
import torch
import transformers

from engine.attention.mla_backend import MlaAttentionBackend
from engine.attention.selector import (
    BackendChoice,
    create_attention_backend,
    for_model,
)
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu_kernels import kernels
from engine.layers.config import ModelConfig
from engine.models.deepseek import checkpoint_names
from engine.models.registry import config_from_hf, load_model_config
from engine.process.build import build_engine
from engine.process.load import _page_bytes
from shared.config import EngineConfig
from shared.protocol import EngineRequest, SamplingParams, pack_ids, unpack_ids
from tests.tiny_vlm import tiny_vlm_tokenizer
from tests.unit.test_model_reference import STEPS, TINY, VOCAB, _run, make_reference

CPU = torch.device("cpu")
_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            # transformers' MLA repeats its latent K/V per KV head: one per query head.
            num_key_value_heads=TINY["num_attention_heads"], moe_intermediate_size=32,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            first_k_dense_replace=1)
_NO_THETA = {k: v for k, v in TINY.items() if k != "rope_theta"}
CASES = {
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        _NO_THETA, **_MLA, q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5,
        num_mtp_layers=0, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 32})),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(
        TINY, **_MLA, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
        topk_method="group_limited_greedy")),
}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(request, tmp_path_factory):
    case = request.param
    config_cls, model_cls, kwargs = CASES[case]
    path = tmp_path_factory.mktemp(case)
    return case, make_reference(path, config_cls, model_cls, kwargs, seed=8)


def test_config_and_reference(reference):
    case, ref = reference
    config = load_model_config(ref.path)
    assert config.architecture == case
    mla = config.mla
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.latent_width) == (32, 8, 40)
    assert mla.q_lora_rank == (48 if case == "deepseek_v3" else None)
    assert config.moe.dense_layers == (0,) and config.moe.num_experts == 8
    hf = transformers.AutoConfig.from_pretrained(ref.path)
    scaling = transformers.AutoModelForCausalLM.from_config(hf).model.layers[0].self_attn.scaling
    assert mla.softmax_scale == pytest.approx(scaling, rel=1e-12)
    if case == "deepseek_v3":  # YaRN's mscale_all_dim: not the plain 24 ** -0.5
        assert mla.softmax_scale != pytest.approx(24 ** -0.5)
    for logits in ref.step_logits:  # no greedy near-ties to forgive
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


MODES = [("alone", False), ("together", True), ("single-chunk", False),
         ("prefix-cached", False)]


@pytest.mark.parametrize(("mode", "use_kernels"), MODES, ids=[m for m, _ in MODES])
def test_matches_transformers(reference, mode, use_kernels):
    """Greedy tokens equal generate's; every step's logits within 1e-4. Chunked and whole
    prefill, batched decode and prefix-cache hits all read the same latent pages."""
    _, ref = reference
    tokens, logits, num_steps = _run(ref.path, ref.prompts, mode,
                                     kernels() if use_kernels else None)
    assert num_steps == STEPS if mode == "single-chunk" else num_steps > STEPS
    for i in range(len(ref.prompts)):
        assert logits[i].shape == (STEPS, VOCAB)
        torch.testing.assert_close(logits[i][0], ref.first_logits[i], atol=1e-4, rtol=0)
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i], f"prompt {i}"


@pytest.mark.parametrize("num_pages", [64, 16], ids=["roomy", "preempting"])
def test_served_by_build_engine(reference, num_pages):
    """`sluice serve DIR`'s engine: the registry's family, the selector's latent backend;
    all prompts at once, chunked. With 16 pages of 4 (one sequence of max_model_len 64) the
    prompts and their generations do not fit together: sequences are preempted, their
    latent pages freed, and recomputed later to the same tokens."""
    _, ref = reference
    tiny_vlm_tokenizer().save_pretrained(ref.path)
    core = build_engine(EngineConfig(
        model=ref.path, served_model_name="m", request_address="inproc://x", device="cpu",
        dtype="float32", attention_backend="torch", num_pages=num_pages, page_size=4,
        max_num_batched_tokens=8, threads=1, max_model_len=64))
    assert isinstance(core.runner.backend, MlaAttentionBackend)
    for i, prompt in enumerate(ref.prompts):
        core.add(EngineRequest(
            request_id=f"r{i}", prompt_token_ids=pack_ids(prompt), reply_to="tcp://test",
            params=SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True),
            arrival_time=0.0))
    tokens = {f"r{i}": [] for i in range(len(ref.prompts))}
    while core.has_work:
        for _, out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(unpack_ids(out.new_token_ids).tolist())
    assert [tokens[f"r{i}"] for i in range(len(ref.prompts))] == ref.tokens
    assert (core.num_preemptions > 0) == (num_pages == 16)


# --- the cache layout: one latent row per token per layer ------------------------------------


def _v3_config(**overrides) -> ModelConfig:
    """Our reading of DeepseekV3Config's defaults: DeepSeek-V3 / R1's published shape."""
    hf = transformers.DeepseekV3Config(**overrides)
    return config_from_hf(hf.to_json_string().encode())


def test_latent_cache_bytes_per_token():
    """The backend allocates kv_lora_rank + qk_rope_head_dim per token per layer, as the
    page arithmetic says; a plain-attention model of the same heads and head width would
    hold K and V of every head."""
    config = _v3_config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                        v_head_dim=16, q_lora_rank=None, n_routed_experts=8, n_group=4,
                        topk_group=2, num_experts_per_tok=2)
    assert config.kv_elements_per_token() == 2 * 40
    mla = create_attention_backend("torch", config, 3, 4, torch.float32, CPU)
    assert [tuple(c.shape) for c in mla.latent_cache] == [(12, 1, 40)] * 2
    assert mla.cache_bytes_per_token() == 2 * 40 * 4
    plain = msgspec.structs.replace(config, mla=None)  # 4 heads of K and V, 24 wide
    dense = TorchAttentionBackend(2, 3, 4, plain.num_kv_heads, plain.head_dim, torch.float32,
                                  CPU)
    dense_bytes = sum(c[0].numel() * 4 for c in dense.k_cache + dense.v_cache)
    assert dense_bytes == plain.kv_elements_per_token() * 4 == 2 * 2 * 4 * 24 * 4
    engine = EngineConfig(model="x", served_model_name="m", request_address="inproc://x",
                          page_size=16)
    assert _page_bytes(engine, config, torch.bfloat16) == 16 * 2 * 40 * 2
    assert _page_bytes(engine, plain, torch.bfloat16) == 16 * 2 * 2 * 4 * 24 * 2


def test_deepseek_v3_kv_per_token():
    """docs/models.md's numbers: DeepSeek-V3's 61 layers hold 576 values a token each
    (70,272 bytes in bfloat16); its 128 heads' K (192) and V (128) would be 40,960 a layer
    (71x), a Llama-3-70B-style 8 KV heads of 128 (K and V) 2,048 (3.6x)."""
    config = _v3_config()
    assert (config.num_layers, config.mla.latent_width) == (61, 576)
    assert config.kv_elements_per_token() * 2 == 70_272
    heads = config.num_heads * (config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim
                                + config.mla.v_head_dim)
    assert heads == 40_960 and heads // 576 == 71
    assert round(2 * 8 * 128 / 576, 1) == 3.6


# --- what is refused, and the names skipped ---------------------------------------------------


def test_flashinfer_and_batch_invariant_refused_auto_revised():
    config = _v3_config(num_hidden_layers=1)
    with pytest.raises(ValueError, match="multi-head latent attention.*--attention-backend torch"):
        create_attention_backend("flashinfer", config, 2, 4, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="--batch-invariant"):
        create_attention_backend("torch", config, 2, 4, torch.float32, CPU,
                                 batch_invariant=True)
    auto = BackendChoice("flashinfer", "auto: CUDA device with flashinfer installed")
    assert for_model(auto, config).name == "torch"
    asked = BackendChoice("flashinfer", "--attention-backend flashinfer")
    assert for_model(asked, config) is asked  # refused when the backend is made


@pytest.mark.parametrize(("overrides", "key"), [
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(n_group=3), "n_group"),  # 256 experts do not split into 3 groups
    (dict(topk_group=9), "topk_group"),  # more kept groups than the 8 there are
    (dict(n_group=8, topk_group=1, num_experts_per_tok=33), "topk_group"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(num_experts_per_tok=257), "num_experts_per_tok"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_config_refusals(overrides, key):
    raw = transformers.DeepseekV3Config().to_dict() | overrides
    with pytest.raises(ValueError, match=f"config.json {key}"):
        config_from_hf(msgspec.json.encode(raw))


def test_multi_token_prediction_layers_skipped():
    """V3's checkpoints store the MTP module as model.layers.61: not a served layer."""
    rename = checkpoint_names(_v3_config())
    assert rename("model.layers.61.eh_proj.weight") is None
    assert rename("model.layers.60.self_attn.kv_b_proj.weight") == (
        "model.layers.60.self_attn.kv_b_proj.weight")
    assert rename("lm_head.weight") == "lm_head.weight"
