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

import json
import os

import msgspec
import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine.attention.mla_backend import MlaAttentionBackend
from engine.attention.selector import (
    BackendChoice,
    create_attention_backend,
    for_model,
)
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu_kernels import kernels
from engine.layers.config import ModelConfig
from engine.layers.rotary import RotaryEmbedding
from engine.models.deepseek import checkpoint_names
from engine.models.registry import config_from_hf, load_model_config
from engine.process.build import build_engine
from engine.process.load import _page_bytes
from shared.config import EngineConfig
from shared.speculative import parse_speculative_config
from tests.tiny_vlm import tiny_vlm_tokenizer
from tests.unit.engine_builders import greedy_tokens
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


SPEC = parse_speculative_config(
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')


@pytest.mark.parametrize(("num_pages", "spec"), [(64, None), (16, None), (64, SPEC)],
                         ids=["roomy", "preempting", "speculative"])
def test_served_by_build_engine(reference, num_pages, spec):
    """`sluice serve DIR`'s engine: the registry's family, the selector's latent backend;
    all prompts at once, chunked. With 16 pages of 4 (one sequence of max_model_len 64) the
    prompts and their generations do not fit together: sequences are preempted, their
    latent pages freed, and recomputed later to the same tokens. With n-gram drafts each
    draft token is a decode row over the latent pages, verified to greedy's tokens."""
    _, ref = reference
    tiny_vlm_tokenizer().save_pretrained(ref.path)
    core = build_engine(EngineConfig(
        model=ref.path, served_model_name="m", request_address="inproc://x", device="cpu",
        dtype="float32", attention_backend="torch", num_pages=num_pages, page_size=4,
        max_num_batched_tokens=8, threads=1, max_model_len=64, speculative=spec))
    assert isinstance(core.runner.backend, MlaAttentionBackend)
    drafted = []
    if spec is not None:
        record = core.scheduler.drafter.record
        core.scheduler.drafter.record = lambda seq, proposed, accepted: (
            drafted.append(proposed), record(seq, proposed, accepted))
    assert greedy_tokens(core, ref.prompts, STEPS) == ref.tokens
    assert (core.num_preemptions > 0) == (num_pages == 16)
    assert bool(drafted) == (spec is not None)


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


# --- llama.cpp's deepseek2 GGUF ---------------------------------------------------------------


def _write_deepseek2_gguf(folder: str, path: str, hf, gating=None) -> None:
    """What convert_hf_to_gguf.py's DeepseekV2Model writes, in float32: MLA as MQA
    metadata, kv_b_proj split into attn_k_b (each head's key half transposed) and attn_v_b,
    experts stacked, e_score_correction_bias as exp_probs_b.bias, YaRN's mscale_all_dim as
    yarn_log_multiplier; llama.cpp's names from gguf's own TensorNameMap."""
    import gguf

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    arch = gguf.MODEL_ARCH.DEEPSEEK2
    names = gguf.get_tensor_name_map(arch, hf.num_hidden_layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    v3 = hf.model_type == "deepseek_v3"
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
    if hf.q_lora_rank is not None:
        writer.add_q_lora_rank(hf.q_lora_rank)
    writer.add_kv_lora_rank(hf.kv_lora_rank)
    writer.add_key_length(hf.kv_lora_rank + hf.qk_rope_head_dim)
    writer.add_value_length(hf.kv_lora_rank)
    writer.add_key_length_mla(hf.qk_nope_head_dim + hf.qk_rope_head_dim)
    writer.add_value_length_mla(hf.v_head_dim)
    writer.add_rope_dimension_count(hf.qk_rope_head_dim)
    writer.add_leading_dense_block_count(hf.first_k_dense_replace)
    writer.add_expert_count(hf.n_routed_experts)
    writer.add_expert_used_count(hf.num_experts_per_tok)
    writer.add_expert_feed_forward_length(hf.moe_intermediate_size)
    writer.add_expert_shared_count(hf.n_shared_experts)
    writer.add_expert_weights_scale(hf.routed_scaling_factor)
    writer.add_expert_weights_norm(bool(hf.norm_topk_prob))
    if gating is None:
        gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    writer.add_uint32(f"{gguf.MODEL_ARCH_NAMES[arch]}.expert_gating_func", int(gating))
    writer.add_expert_group_count(hf.n_group)
    writer.add_expert_group_used_count(hf.topk_group)
    rope = hf.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    heads, nope = hf.num_attention_heads, hf.qk_nope_head_dim
    for name, tensor in sorted(tensors.items()):
        parts = name.split(".")
        if name.endswith("kv_b_proj.weight"):
            kv_b = tensor.view(heads, nope + hf.v_head_dim, -1)
            block = f"blk.{parts[2]}"
            writer.add_tensor(f"{block}.attn_k_b.weight",
                              kv_b[:, :nope].transpose(1, 2).contiguous().numpy())
            writer.add_tensor(f"{block}.attn_v_b.weight", kv_b[:, nope:].contiguous().numpy())
        elif ".experts." in name:
            if parts[5] == "0":  # the layer's experts, stacked
                proj = parts[6]
                stacked = torch.stack([tensors[f"model.layers.{parts[2]}.mlp.experts.{e}."
                                               f"{proj}.weight"]
                                       for e in range(hf.n_routed_experts)])
                gguf_proj = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                             "down_proj": "ffn_down_exps"}[proj]
                writer.add_tensor(f"blk.{parts[2]}.{gguf_proj}.weight", stacked.numpy())
        elif name.endswith("e_score_correction_bias"):
            writer.add_tensor(f"blk.{parts[2]}.exp_probs_b.bias", tensor.numpy())
        else:
            mapped = names.get_name(name.removesuffix(".weight"))
            assert mapped is not None, name
            writer.add_tensor(f"{mapped}.weight", tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_deepseek2_gguf(reference, tmp_path):
    """The converter's deepseek2 file of the checkpoint reads to the same config and serves
    transformers' tokens and logits."""
    case, ref = reference
    config_cls, _, kwargs = CASES[case]
    path = str(tmp_path / f"tiny-{case}.gguf")
    _write_deepseek2_gguf(ref.path, path, config_cls(**kwargs))
    from_gguf, from_hf = load_model_config(path), load_model_config(ref.path)
    assert from_gguf.architecture == case
    assert from_gguf.mla == from_hf.mla and from_gguf.moe == from_hf.moe
    assert from_gguf.family_options == from_hf.family_options
    # The same rotary tables (the file's YaRN beta defaults are the config's unset ones).
    tables = [RotaryEmbedding(c, 128, torch.float32, CPU) for c in (from_gguf, from_hf)]
    assert torch.equal(tables[0].cos, tables[1].cos) and torch.equal(tables[0].sin,
                                                                     tables[1].sin)
    tokens, logits, _ = _run(path, ref.prompts, "together", kernels())
    for i in range(len(ref.prompts)):
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i]


@pytest.mark.parametrize("gating", [0, 3])
def test_deepseek2_gguf_unknown_gating_refused(reference, tmp_path, gating):
    """Only llama.cpp's softmax (1) and sigmoid (2) gating functions are read."""
    case, ref = reference
    config_cls, _, kwargs = CASES[case]
    path = str(tmp_path / "bad.gguf")
    _write_deepseek2_gguf(ref.path, path, config_cls(**kwargs), gating=gating)
    with pytest.raises(ValueError, match="expert_gating_func"):
        load_model_config(path)


@pytest.mark.parametrize(("config_cls", "arch"), [
    (transformers.DeepseekV3Config, "DeepseekV3ForCausalLM"),
    (transformers.DeepseekV2Config, "DeepseekV2ForCausalLM")])
def test_keys_left_out_take_transformers_defaults(config_cls, arch):
    """A config.json that leaves the MLA and routing keys out reads as transformers fills
    them in (V2's defaults are not V3's: no groups, softmax greedy, two shared experts)."""
    given = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_experts_per_tok=4)
    sparse = {"architectures": [arch], "model_type": config_cls.model_type, **given}
    full = json.loads(config_cls(**given, architectures=[arch]).to_json_string())
    assert config_from_hf(json.dumps(sparse).encode()) == config_from_hf(
        json.dumps(full).encode())
