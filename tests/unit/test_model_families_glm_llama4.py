"""GLM-4.5 (Glm4MoeForCausalLM) and Llama 4 text (Llama4ForCausalLM), as
tests/unit/test_model_families.py tests the other families: a tiny random-weight
transformers model per case, saved with save_pretrained, read by our config reader and
loader, served by EngineCore (paged torch attention, chunks of 8, batching, a prefix-cache
hit, preemption) and compared with transformers' greedy generate in float32, logits within
1e-4.

GLM: partial rotary (8 of 16 dims), q/k norms, q/k/v biases, one dense layer first, then
top-2 of 8 experts in 4 groups of which 2 are kept, a random correction bias, a scaling
factor and a shared expert. Llama 4: chunks of 8 in the rotary layers and a NoPE layer with
full attention and temperature tuning (floor_scale 8, so positions past it are scaled), QK
L2 norm, MoE every 2nd layer (top-1, sigmoid, with a shared expert)."""

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.kernels.cpu_kernels import kernels
from engine.models.registry import load_model_config
from tests.unit.test_model_families import _common_metadata, _engine_config
from tests.unit.test_model_reference import STEPS, TINY, VOCAB, _run, make_reference

CHUNK = 8


def _random_correction_bias(model) -> None:
    """A buffer transformers leaves at zero: random here, so the choice it shifts shows."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(
                    0.5 * torch.randn(gate.e_score_correction_bias.shape, generator=gen))


CASES = {
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, dict(
        head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True),
        _random_correction_bias),
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=CHUNK, no_rope_layer_interval=4, floor_scale=8,
        attn_scale=0.5), None),
}
SEEDS: dict[str, int] = {}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=sorted(CASES))
def reference(request, tmp_path_factory):
    case = request.param
    config_cls, model_cls, overrides, prepare = CASES[case]
    path = tmp_path_factory.mktemp(case)
    return case, make_reference(path, config_cls, model_cls, {**TINY, **overrides},
                                SEEDS.get(case, 8), prepare=prepare)


def test_config_and_reference(reference):
    case, ref = reference
    config = load_model_config(ref.path)
    assert config.architecture == case
    if case == "glm4_moe":
        assert config.rotary_dim == 8 and config.qk_norm and config.attention_bias
        moe = config.moe
        assert (moe.num_experts, moe.top_k, moe.dense_layers) == (8, 2, (0,))
        assert moe.shared_expert_intermediate_size == 64
        options = config.family_options
        assert (options.num_groups, options.topk_groups) == (4, 2)
        assert options.routed_scaling_factor == 2.5
    else:
        chunks = [config.attention_of(i).chunk for i in range(config.num_layers)]
        assert chunks == [CHUNK, CHUNK, CHUNK, None] and config.nope_layers == (3,)
        assert config.kv_window is None  # the NoPE layer attends the whole context
        assert config.moe.dense_layers == (0, 2) and config.intermediate_size == 96
        assert (config.moe.intermediate_size, config.moe.top_k) == (32, 1)
        assert config.family_options.floor_scale == 8
    for logits in ref.step_logits:  # no greedy near-ties: the comparison means something
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    assert len({tuple(seq) for seq in ref.tokens}) == len(ref.tokens)


MODES = [("alone", False), ("together", True), ("single-chunk", False),
         ("prefix-cached", False)]


@pytest.mark.parametrize(("mode", "use_kernels"), MODES, ids=[m for m, _ in MODES])
def test_matches_transformers(reference, mode, use_kernels):
    """Chunked prefill (chunks of 8), whole prefill (single-chunk), one at a time, batched,
    and after prefix-cache hits: every step's logits and the greedy tokens."""
    _, ref = reference
    tokens, logits, _ = _run(ref.path, ref.prompts, mode, kernels() if use_kernels else None)
    for i, prompt in enumerate(ref.prompts):
        assert logits[i].shape == (STEPS, VOCAB), f"prompt {i}"
        torch.testing.assert_close(logits[i][0], ref.first_logits[i], atol=1e-4, rtol=0)
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i], f"prompt {i} (length {len(prompt)})"


def _serve(ref, **overrides):
    """All prompts at once through `sluice serve DIR`'s engine (registry, backend told each
    layer's attention, default ops): (tokens per prompt, the core)."""
    from engine.process.build import build_engine
    from tests.tiny_vlm import tiny_vlm_tokenizer
    from tests.unit.engine_builders import greedy_tokens

    tiny_vlm_tokenizer().save_pretrained(ref.path)
    core = build_engine(_engine_config(ref.path, threads=1, **overrides))
    return greedy_tokens(core, ref.prompts, STEPS), core


def test_served_by_build_engine(reference):
    """`sluice serve DIR`'s engine builds the family and serves transformers' tokens."""
    _, ref = reference
    tokens, _ = _serve(ref)
    assert tokens == ref.tokens


def test_preempted_equal_a_fresh_run(reference):
    """16 pages of 4 tokens hold one prompt with its generation (at most 13 pages), not
    all four (about 38): sequences are preempted and recomputed, with the same tokens."""
    _, ref = reference
    tokens, core = _serve(ref, page_size=4, num_pages=16, max_model_len=64)
    assert core.num_preemptions > 0
    assert tokens == ref.tokens


@pytest.mark.parametrize("reference", ["llama4"], indirect=True)
def test_llama4_conditional_generation_text_model(reference, tmp_path):
    """A Llama4ForConditionalGeneration folder (text_config nested, the text model under
    language_model., a vision tower beside it) serves its text model: the same tokens."""
    _, ref = reference
    with open(os.path.join(ref.path, "config.json")) as f:
        text = json.load(f)
    wrapper = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
               "text_config": text, "vision_config": {"hidden_size": 8}}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(wrapper, f)
    tensors = {f"language_model.{k}": v
               for k, v in load_file(os.path.join(ref.path, "model.safetensors")).items()}
    tensors["vision_model.patch_embedding.weight"] = torch.zeros(8, 3)
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(8, 8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert load_model_config(str(tmp_path)).architecture == "llama4"
    tokens, logits, _ = _run(str(tmp_path), ref.prompts, "together")
    for i in range(len(ref.prompts)):
        torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
        assert tokens[i] == ref.tokens[i]


@pytest.mark.parametrize(("case", "fields", "match"), [
    ("glm4_moe", {"n_group": 3}, "n_group: 3 does not split 8 experts"),
    ("glm4_moe", {"n_group": 8}, "n_group: 8 does not split 8 experts into groups of 2"),
    ("glm4_moe", {"topk_group": 5}, r"topk_group: 5 is not within 1..4"),
    ("glm4_moe", {"topk_group": 0}, r"topk_group: 0 is not within"),
    ("glm4_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok: 9 is not within 1..8"),
    ("glm4_moe", {"n_shared_experts": 0}, "n_shared_experts"),
    ("glm4_moe", {"first_k_dense_replace": 4}, r"first_k_dense_replace: 4 is not within"),
    ("glm4_moe", {"topk_method": "greedy"}, "topk_method"),
    ("glm4_moe", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama4", {"attention_chunk_size": 0}, "attention_chunk_size: 0 is not positive"),
    ("llama4", {"attention_chunk_size": -8}, "attention_chunk_size: -8 is not positive"),
    ("llama4", {"attention_chunk_size": None}, "attention_chunk_size: chunked_attention layers"),
    ("llama4", {"no_rope_layers": [1, 1, 0]}, r"no_rope_layers: needs one 0 or 1 per layer"),
    ("llama4", {"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers"),
    ("llama4", {"layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ("llama4", {"moe_layers": [4]}, r"moe_layers: names layers outside 0..3"),
    ("llama4", {"num_experts_per_tok": 0}, r"num_experts_per_tok: 0 is not within 1..4"),
    ("llama4", {"floor_scale": 0}, "floor_scale: 0.0 is not positive"),
    ("llama4", {"attention_bias": True}, "attention_bias"),
])
def test_bad_config_refused(tmp_path, case, fields, match):
    """What the engine would compute wrongly is refused at start, the key named."""
    config_cls, _, overrides, _ = CASES[case]
    config = json.loads(config_cls(**{**TINY, **overrides}).to_json_string())
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config | fields, f)
    with pytest.raises(ValueError, match=f"config.json {match}"):
        load_model_config(str(tmp_path))


# --- GGUF: the files convert_hf_to_gguf.py writes, under llama.cpp's own names ------------------


def _q8_exact(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., in] rounded to what Q8_0 stores exactly along `in`."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    array = rows.contiguous().numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, q8), q8))


def _round_experts(model) -> None:
    """Every expert weight Q8_0-exact along its input dimension, so that a GGUF holding
    the experts as Q8_0 blocks is the checkpoint itself."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." not in name:
                continue
            if isinstance(model, transformers.Llama4ForCausalLM):  # stacks [E, in, out]
                param.copy_(_q8_exact(param.transpose(1, 2)).transpose(1, 2))
            else:  # GLM's (transformers' fused layout): [E, out, in]
                param.copy_(_q8_exact(param))


def _write_gguf(path: str, arch, tensors: dict, metadata) -> None:
    """Float32, but the stacked experts (ffn_*_exps) as Q8_0 blocks."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    metadata(writer)
    for name, array in sorted(tensors.items()):
        array = array.contiguous().numpy()
        if "_exps." in name:
            writer.add_tensor(name, gguf.quants.quantize(array, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_names(hf_tensors: dict, arch, layers: int, experts) -> dict:
    """HF tensors under gguf's TensorNameMap names; experts(name, tensor) -> {GGUF name:
    tensor} for the ones the map does not take as they are (or None)."""
    import gguf

    names, out = gguf.get_tensor_name_map(arch, layers), {}
    for name, tensor in hf_tensors.items():
        special = experts(name, tensor)
        if special is not None:
            out.update(special)
            continue
        stem, _, suffix = name.rpartition(".")
        mapped = names.get_name(stem)
        assert mapped is not None, name
        out[f"{mapped}.{suffix}"] = tensor
    return out


def _check_gguf(path: str, ref, arch: str) -> None:
    """Dequantized at load; then, with the CPU kernels, the experts held as their Q8_0
    blocks alone (meta weights the ops multiply)."""
    assert load_model_config(path).architecture == arch
    compiled = kernels()
    for quantized in (False, True) if compiled is not None else (False,):
        tokens, logits, _ = _run(path, ref.prompts, "together", compiled, quantized=quantized)
        for i in range(len(ref.prompts)):
            torch.testing.assert_close(logits[i], ref.step_logits[i], atol=1e-4, rtol=0)
            assert tokens[i] == ref.tokens[i], quantized


def test_glm4moe_gguf(tmp_path):
    """glm4moe: stacked experts [E, out, in], the correction bias as exp_probs_b.bias, the
    router's settings and the rotary width in the metadata; a nextn (MTP) block after the
    last layer, counted in block_count, is left out."""
    import gguf

    config_cls, model_cls, overrides, prepare = CASES["glm4_moe"]
    kwargs = {**TINY, **overrides}

    def prepared(model):
        prepare(model)
        _round_experts(model)

    ref = make_reference(tmp_path / "hf", config_cls, model_cls, kwargs, seed=8,
                         prepare=prepared)
    hf = config_cls(**kwargs)
    layers = hf.num_hidden_layers
    hf_tensors = load_file(os.path.join(ref.path, "model.safetensors"))
    stacked: dict = {}

    def experts(name, tensor):
        parts = name.split(".")
        if name.endswith("e_score_correction_bias"):
            return {f"blk.{parts[2]}.exp_probs_b.bias": tensor}
        if ".experts." in name:  # model.layers.i.mlp.experts.e.gate_proj.weight
            stacked.setdefault((parts[2], parts[6]), {})[int(parts[5])] = tensor
            return {}
        return None

    tensors = _gguf_names(hf_tensors, gguf.MODEL_ARCH.GLM4_MOE, layers, experts)
    kind = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    for (layer, proj), per_expert in stacked.items():
        tensors[f"blk.{layer}.{kind[proj]}.weight"] = torch.stack(
            [per_expert[e] for e in sorted(per_expert)])
    tensors[f"blk.{layers}.nextn.eh_proj.weight"] = torch.zeros(64, 128)
    tensors[f"blk.{layers}.attn_norm.weight"] = torch.ones(64)

    def metadata(writer) -> None:
        _common_metadata(writer, hf, hf.head_dim)
        writer.add_block_count(layers + 1)
        writer.add_nextn_predict_layers(1)
        writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
        writer.add_rope_dimension_count(8)
        writer.add_expert_count(hf.n_routed_experts)
        writer.add_expert_used_count(hf.num_experts_per_tok)
        writer.add_expert_feed_forward_length(hf.moe_intermediate_size)
        writer.add_expert_shared_count(hf.n_shared_experts)
        writer.add_leading_dense_block_count(hf.first_k_dense_replace)
        writer.add_expert_weights_scale(hf.routed_scaling_factor)
        writer.add_expert_weights_norm(hf.norm_topk_prob)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(hf.n_group)
        writer.add_expert_group_used_count(hf.topk_group)

    path = str(tmp_path / "tiny-glm4moe.gguf")
    _write_gguf(path, gguf.MODEL_ARCH.GLM4_MOE, tensors, metadata)
    config = load_model_config(path)
    assert config.num_layers == layers and config.rotary_dim == 8
    assert config.qk_norm and config.attention_bias and config.moe.dense_layers == (0,)
    _check_gguf(path, ref, "glm4_moe")


def test_llama4_gguf(tmp_path):
    """llama4: gate_up split into ffn_gate_exps / ffn_up_exps and down into ffn_down_exps,
    [E, out, in]; q/k as the checkpoint's. llama.cpp fixes the chunk (8192), the NoPE
    pattern (every 4th) and the temperature (0.1, 8192): the reference model has those."""
    import gguf

    config_cls, model_cls, overrides, _ = CASES["llama4"]
    kwargs = {**TINY, **overrides, "attention_chunk_size": 8192, "floor_scale": 8192,
              "attn_scale": 0.1}
    ref = make_reference(tmp_path / "hf", config_cls, model_cls, kwargs, seed=8,
                         prepare=_round_experts)
    hf = config_cls(**kwargs)
    inter = hf.intermediate_size

    def experts(name, tensor):
        layer = name.split(".")[2] if ".layers." in name else None
        if name.endswith("experts.gate_up_proj"):  # [E, hidden, 2 * inter]
            return {f"blk.{layer}.ffn_gate_exps.weight": tensor[..., :inter].transpose(1, 2),
                    f"blk.{layer}.ffn_up_exps.weight": tensor[..., inter:].transpose(1, 2)}
        if name.endswith("experts.down_proj"):  # [E, inter, hidden]
            return {f"blk.{layer}.ffn_down_exps.weight": tensor.transpose(1, 2)}
        return None

    tensors = _gguf_names(load_file(os.path.join(ref.path, "model.safetensors")),
                          gguf.MODEL_ARCH.LLAMA4, hf.num_hidden_layers, experts)

    def metadata(writer) -> None:
        _common_metadata(writer, hf, hf.head_dim)
        writer.add_feed_forward_length(hf.intermediate_size_mlp)
        writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
        writer.add_expert_count(hf.num_local_experts)
        writer.add_expert_used_count(hf.num_experts_per_tok)
        writer.add_expert_feed_forward_length(inter)
        writer.add_interleave_moe_layer_step(hf.interleave_moe_layer_step)

    path = str(tmp_path / "tiny-llama4.gguf")
    _write_gguf(path, gguf.MODEL_ARCH.LLAMA4, tensors, metadata)
    config = load_model_config(path)
    assert config.nope_layers == (3,) and config.moe.dense_layers == (0, 2)
    assert [config.attention_of(i).chunk for i in range(4)] == [8192, 8192, 8192, None]
    _check_gguf(path, ref, "llama4")


def test_released_config_spellings(tmp_path):
    """As Llama-4-Scout's config.json writes them: no_rope_layers [] (the every-4th
    default), attn_temperature_tuning 4 (true), a llama3 rope_scaling, head_dim absent
    (transformers' 128); GLM-4.5's: partial_rotary_factor at the top level, or absent
    (transformers' 0.5)."""
    text = {"model_type": "llama4_text", "vocab_size": 256, "hidden_size": 128,
            "intermediate_size": 32, "intermediate_size_mlp": 64, "num_hidden_layers": 8,
            "num_attention_heads": 2, "num_key_value_heads": 1, "no_rope_layers": [],
            "attn_temperature_tuning": 4, "floor_scale": 8192, "interleave_moe_layer_step": 1,
            "rope_theta": 500000.0, "rope_scaling": {
                "factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    wrapper = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
               "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    config = load_model_config(str(tmp_path))
    assert config.nope_layers == (3, 7) and config.head_dim == 128
    assert config.family_options.temperature_tuning is True
    assert config.rope_scaling.rope_type == "llama3" and config.moe.dense_layers == ()
    assert [config.attention_of(i).chunk for i in range(8)] == [8192] * 3 + [None] + \
        [8192] * 3 + [None]
    glm = json.loads(transformers.Glm4MoeConfig(**{**TINY, "head_dim": 16}).to_json_string())
    glm.pop("rope_parameters")
    for extra, rotary in (({"partial_rotary_factor": 0.25, "rope_theta": 1e6}, 4), ({}, 8)):
        (tmp_path / "config.json").write_text(json.dumps(glm | extra))
        assert load_model_config(str(tmp_path)).rotary_dim == rotary


@pytest.mark.parametrize(("arch", "keys", "match"), [
    ("llama4", {"attention.sliding_window": 0}, r"attention.sliding_window: 0 \(no chunked"),
    ("llama4", {"interleave_moe_layer_step": 0}, "interleave_moe_layer_step: 0 is not"),
    ("glm4moe", {"expert_gating_func": 1}, "expert_gating_func: only sigmoid"),
])
def test_bad_gguf_refused(tmp_path, arch, keys, match):
    """A file asking for what llama.cpp's reading of it does not give is refused."""
    import gguf

    path = str(tmp_path / "meta.gguf")
    writer = gguf.GGUFWriter(path, arch)
    base = {"context_length": 128, "embedding_length": 64, "feed_forward_length": 32,
            "block_count": 4, "attention.head_count": 4, "attention.head_count_kv": 2,
            "attention.key_length": 16, "expert_count": 4, "expert_used_count": 1,
            "expert_feed_forward_length": 32, "interleave_moe_layer_step": 2}
    for key, value in (base | keys).items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", torch.zeros(32, 64).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"config.json GGUF {match}"):
        load_model_config(path)
