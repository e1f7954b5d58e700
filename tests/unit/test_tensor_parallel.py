"""Tensor parallelism (engine.parallel) on the CPU with gloo: an engine of N ranks (this
process is rank 0, the others are the worker processes it starts) against the same model at
one rank, in float32, through EngineCore: chunked prefill (an 8-token budget), decode,
prefix-cache hits (every prompt runs twice), prompt logprobs and logprobs. Greedy tokens
equal, logprobs within float32 tolerance.

Tiny random transformers checkpoints cover each sharding case: KV heads split across ranks,
fewer KV heads than ranks (replicated), 3 ranks over a vocabulary and an intermediate that
do not divide by 3 (zero-padded parts), q/k norms, q/k/v biases (dense Qwen2), MoE experts
with a shared expert; and each family beyond Llama's blocks, on the checkpoints of
tests/unit/test_model_families.py: Qwen3-MoE (a dense layer among MoE ones), Mixtral (w1/w3/w2
experts, a window on every layer), Gemma 2 and 3 (GeGLU, scaled embedding, soft caps, two
rotary bases), Phi-3 (fused qkv_proj with one KV head on 2 ranks, fused gate_up_proj),
Phi-4-mini (partial rotary), gpt-oss (attention sinks, o_proj and expert biases, stacked
interleaved experts over an odd intermediate size, so the last rank's part is padded). On
every MoE case rank 0 holds its part of the experts, not all of them. Every family in
engine.layers.sharding.TP_FAMILIES has a case. LoRA adapters sliced over 2 ranks against
one rank, and each module's slices against the whole low-rank product."""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys

import gguf
import msgspec
import numpy as np
import pytest
import torch
import transformers

import engine.step.lora_adapters as engine_lora
from engine.layers.config import MoeConfig
from engine.layers.gguf_weights import BLOCK_KINDS
from engine.layers.sharding import TP_FAMILIES, Shard, check_tensor_parallel
from engine.models.gpt_oss import GptOssOptions, dequantize_mxfp4
from engine.models.registry import load_model_config, load_quantized_weights, load_weights
from engine.parallel.leader import Watchdog
from engine.parallel.rendezvous import plan_rendezvous
from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.protocol import (
    EngineRequest,
    ImageInput,
    LoraAdapterInfo,
    LoraUpdate,
    PoolingParams,
    SamplingParams,
    pack_ids,
    pack_tensor,
    unpack_ids,
    unpack_tensor,
)
from shared.startup_checks import StartupError
from shared.transport import free_tcp_port
from sluice import cli
from tests.servers import wait_until
from tests.tiny_embedder import build_embedder, reference_vector
from tests.tiny_vlm import build_tiny_vlm, tiny_vlm_tokenizer
from tests.unit.engine_builders import CONFIG
from tests.unit.kquant_builders import LlamaShape, write_q4_k_m
from tests.unit.test_model_families import CASES as FAMILIES
from tests.unit.test_model_families import _write_gguf as write_family_gguf
from tests.unit.test_model_reference import TINY, _randomize

# case -> (config class, model class, overrides, ranks)
CASES = {
    # 4 heads, 2 KV heads over 2 ranks: one KV head each.
    "llama-kv-split": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                       dict(num_attention_heads=4, num_key_value_heads=2), 2),
    # One KV head, 2 ranks: both hold it. Tied embeddings: the head is the embedding's shard.
    "llama-kv-replicated": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                            dict(num_attention_heads=4, num_key_value_heads=1,
                                 tie_word_embeddings=True), 2),
    # 6 heads, 3 KV heads over 3 ranks (SmolLM2's shape); vocab 256 and intermediate 128
    # split in 3 are padded; q/k norms.
    "qwen3-tp3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                  dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16), 3),
    # Experts split inside, a shared expert and its gate, q/k/v biases.
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48), 2),
    "gemma2": (*FAMILIES["gemma2"], 2),
    "gemma3": (*FAMILIES["gemma3"], 2),
    "phi3": (*FAMILIES["phi3"][:2], dict(FAMILIES["phi3"][2], num_key_value_heads=1), 2),
    "gpt_oss": (*FAMILIES["gpt_oss"][:2], dict(FAMILIES["gpt_oss"][2], intermediate_size=101),
                2),
    # Dense Qwen2: q/k/v biases split with their heads, no q/k norms.
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(num_attention_heads=4, num_key_value_heads=2), 2),
    # Experts split inside, no shared expert; a dense layer among the MoE ones.
    "qwen3_moe": (*FAMILIES["qwen3_moe"], 2),
    # Mixtral's experts (w1/w3/w2 in its checkpoint) split inside, a window on every layer.
    "mixtral": (*FAMILIES["mixtral"], 2),
    # Phi-4-mini: rotary over part of each head, on each rank's heads.
    "phi4_mini": (*FAMILIES["phi4_mini"], 2),
}
PROMPT_LENGTHS = [1, 6, 19, 27]
STEPS = 10
# `make test-fast` runs one case of each kind of split: heads (and the KV heads with them),
# and experts. Every case starts its ranks as processes (3 to 9 s each on a 2-core host), so
# the others, a case added here included, run in `make test`.
FAST_CASES = {"llama-kv-split", "qwen2_moe"}
SLOW = pytest.mark.slow  # the same model paths as a fast case, through 2 rank processes more


@pytest.fixture(scope="module", params=[c if c in FAST_CASES else pytest.param(c, marks=SLOW)
                                        for c in sorted(CASES)])
def checkpoint(request, tmp_path_factory):
    config_cls, model_cls, overrides, ranks = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = model_cls._from_config(config_cls(**{**TINY, **overrides}),
                                   attn_implementation="eager").to(torch.float32)
    _randomize(model, seed=8)
    model.save_pretrained(path, safe_serialization=True)
    tiny_vlm_tokenizer().save_pretrained(path)
    return str(path), ranks


def _config(path: str, ranks: int) -> EngineConfig:
    return EngineConfig(model=path, served_model_name="m", request_address="inproc://x",
                        device="cpu", dtype="float32", attention_backend="torch",
                        num_pages=64, page_size=4, max_num_batched_tokens=8, threads=1,
                        tensor_parallel_size=ranks, max_model_len=128)


def _serve(core, prompts, images=None) -> dict[str, dict]:
    """Every prompt twice, greedy, with logprobs; the first round with prompt logprobs
    too, the second without (so its prompts hit the prefix cache). images: each prompt's
    ImageInputs (a VLM)."""
    out: dict[str, dict] = {}
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            rid = f"r{round_}-{i}"
            core.add(EngineRequest(
                request_id=rid, prompt_token_ids=pack_ids(prompt), reply_to="tcp://test",
                params=SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True,
                                      logprobs=3,
                                      prompt_logprobs=2 if round_ == 0 else None),
                arrival_time=0.0, images=images[i] if images else []))
            out[rid] = {"tokens": [], "logprobs": [], "prompt_logprobs": None}
        while core.has_work:
            for _, o in core.step():
                assert o.error is None, o.error
                r = out[o.request_id]
                r["tokens"].extend(unpack_ids(o.new_token_ids).tolist())
                if o.logprobs is not None:
                    r["logprobs"].append(np.frombuffer(o.logprobs.top_logprobs, "<f4"))
                if o.prompt_logprobs is not None:
                    r["prompt_logprobs"] = np.frombuffer(o.prompt_logprobs.token_logprobs, "<f4")
    return out


def test_ranks_match_one_rank(checkpoint):
    path, ranks = checkpoint
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()
               for n in PROMPT_LENGTHS]
    _compare(path, ranks, prompts)


def _compare(path: str, ranks: int, prompts, images=None) -> None:
    single = build_engine(_config(path, 1))
    expected = _serve(single, prompts, images)
    core = build_engine(_config(path, ranks))
    try:
        assert core.runner.model.inner.tp.size == ranks
        # An MoE model's experts are split, not replicated: rank 0 holds its part of each
        # (a padded part where the intermediate size does not divide).
        whole, part = _expert_numel(single.runner.model), _expert_numel(core.runner.model.inner)
        if whole:
            assert part * ranks == pytest.approx(whole, rel=0.05), (part, whole)
        got = _serve(core, prompts, images)
        assert core.allocator.prefix_hits > 0
    finally:
        core.runner.model.close()
    for rid, want in expected.items():
        assert got[rid]["tokens"] == want["tokens"], rid
        np.testing.assert_allclose(np.stack(got[rid]["logprobs"]),
                                   np.stack(want["logprobs"]), atol=1e-4, rtol=0)
        if want["prompt_logprobs"] is not None:
            np.testing.assert_allclose(got[rid]["prompt_logprobs"], want["prompt_logprobs"],
                                       atol=1e-4, rtol=0, equal_nan=True)


def test_every_family_tensor_parallelism_serves_has_a_case(tmp_path):
    """A family added to TP_FAMILIES without a case above would be served untested."""
    covered = set()
    for name, (config_cls, _, overrides, _) in CASES.items():
        (tmp_path / name).mkdir()
        config_cls(**{**TINY, **overrides}).to_json_file(str(tmp_path / name / "config.json"))
        covered.add(load_model_config(str(tmp_path / name)).architecture)
    assert set(TP_FAMILIES) <= covered, set(TP_FAMILIES) - covered


def _expert_numel(model) -> int:
    """Weights a model (one rank's) holds in its experts, shared expert included."""
    return sum(w.numel() for layer in model.layers if layer.moe is not None
               for w in layer.moe.linear_weights())


@SLOW
def test_a_vlm_at_two_ranks_matches_one(tmp_path):
    """Idefics3: the text model sharded, the vision encoder on rank 0 only, whose image
    embeddings reach every rank with the step's plan; one image's tokens split over two
    prefill chunks (positions 6..9 over an 8-token budget), a text-only prompt beside."""
    path = build_tiny_vlm(str(tmp_path / "vlm"))
    tok = tiny_vlm_tokenizer()
    image, around = (tok.convert_tokens_to_ids(t) for t in ("<image>",
                                                             "<fake_token_around_image>"))
    words = tok.convert_tokens_to_ids(["describe", "the", "image", "a", "red", "blue", "cat"])
    prompt = words[:5] + [around] + [image] * 4 + [around] + words
    gen = torch.Generator().manual_seed(3)
    pixels = torch.rand((1, 3, 32, 32), generator=gen).numpy()
    picture = ImageInput(pack_tensor(pixels), pack_tensor(np.ones((1, 32, 32), bool)), 5, 6)
    _compare(path, 2, [prompt, words * 3], [[picture], []])


@SLOW
def test_embeddings_at_two_ranks_match_transformers(tmp_path):
    """The pooling runner over 2 ranks: a tiny Qwen3 embedder (a bare-model checkpoint, no
    LM head), last-token pooling, normalized, batched prompts prefilled whole."""
    model = build_embedder(str(tmp_path))
    core = build_engine(msgspec.structs.replace(_config(str(tmp_path), 2), max_model_len=48))
    prompts = [[5, 9, 10], list(range(4, 13)) * 3, [7]]
    try:
        assert core.runner.model.inner.tp.size == 2
        for i, ids in enumerate(prompts):
            core.add(EngineRequest(f"e{i}", pack_ids(ids), SamplingParams(max_tokens=1),
                                   "tcp://test", 0.0, pooling=PoolingParams()))
        outs = {}
        while core.has_work:
            outs.update((o.request_id, o) for _, o in core.step())
    finally:
        core.runner.model.close()
    for i, ids in enumerate(prompts):
        assert outs[f"e{i}"].error is None
        np.testing.assert_allclose(unpack_tensor(outs[f"e{i}"].pooled),
                                   reference_vector(model, ids).numpy(), atol=1e-5, rtol=0)


def _lora_serve(core, prompts) -> dict[str, dict]:
    """Each prompt under the base model and each adapter, in one batch: greedy, logprobs."""
    out: dict[str, dict] = {}
    for i, prompt in enumerate(prompts):
        for name in (None, "a", "b"):
            rid = f"{name}-{i}"
            core.add(EngineRequest(
                request_id=rid, prompt_token_ids=pack_ids(prompt), reply_to="tcp://test",
                params=SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True,
                                      logprobs=3), arrival_time=0.0, lora_name=name))
            out[rid] = {"tokens": [], "logprobs": []}
    while core.has_work:
        for _, o in core.step():
            assert o.error is None, o.error
            out[o.request_id]["tokens"].extend(unpack_ids(o.new_token_ids).tolist())
            if o.logprobs is not None:
                out[o.request_id]["logprobs"].append(np.frombuffer(o.logprobs.top_logprobs,
                                                                   "<f4"))
    return out


def _lora_run(path: str, adapters: dict[str, str], ranks: int, prompts, monkeypatch) -> dict:
    """Adapter a loaded at start, b at run time (after the ranks started, after a load of a
    missing folder was refused, and over ranks one only rank 0 could read); a mixed batch;
    then a unloaded and loaded again (a new id on every rank) for a second batch."""
    core = build_engine(msgspec.structs.replace(
        _config(path, ranks), enable_lora=True, max_loras=2, max_lora_rank=8,
        lora_modules=[LoraAdapterInfo("a", adapters["a"])]))
    try:
        missing = core.update_lora(LoraUpdate("0", "load", "b", adapters["b"] + "-gone"))
        assert missing.status == 404, missing  # refused on rank 0, before any rank reads it
        if ranks > 1:  # a folder only rank 0 reads (the other machines lack it): faked here
            real = engine_lora.read_adapter
            with monkeypatch.context() as m:
                m.setattr(engine_lora, "read_adapter", lambda _, *a: real(adapters["b"], *a))
                lost = core.update_lora(LoraUpdate("x", "load", "c", adapters["b"] + "-gone"))
            assert lost.status == 404 and "tensor-parallel rank 1 cannot load it: No adapter " \
                "found" in lost.message, lost
            assert [i.name for i in core.lora.infos()] == ["a"]
        assert core.update_lora(LoraUpdate("1", "load", "b", adapters["b"])).status == 200
        first = _lora_serve(core, prompts)
        for op, action in (("2", "unload"), ("3", "load")):
            assert core.update_lora(LoraUpdate(op, action, "a", adapters["a"])).status == 200
        second = _lora_serve(core, prompts[:1])
    finally:
        if ranks > 1:
            core.runner.model.close()
    return {**{f"1:{k}": v for k, v in first.items()}, **{f"2:{k}": v for k, v in second.items()}}


def test_lora_adapters_at_two_ranks_match_one(tmp_path, monkeypatch):
    """PEFT adapters sliced over 2 ranks: A on every target (q/k/v, o, gate/up, down) and an
    rsLoRA B of another rank on q, v and down; an intermediate size of 37, so the ranks'
    gate/up rows and down columns (and the adapters' slices of them) are padded. Base rows
    and both adapters in one batch, with chunked prefill and the prefix cache."""
    peft = pytest.importorskip("peft")
    overrides = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=37)
    base = transformers.LlamaForCausalLM._from_config(
        transformers.LlamaConfig(**{**TINY, **overrides}), attn_implementation="eager")
    _randomize(base.to(torch.float32), seed=8)
    base.save_pretrained(tmp_path / "m", safe_serialization=True)
    tiny_vlm_tokenizer().save_pretrained(tmp_path / "m")
    adapters = {}
    for name, seed, config in (
            ("a", 1, dict(r=4, lora_alpha=8, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])),
            ("b", 2, dict(r=8, lora_alpha=16, use_rslora=True,
                          target_modules=["q_proj", "v_proj", "down_proj"]))):
        torch.manual_seed(seed)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            init_lora_weights=False, lora_dropout=0.0, **config))
        model.save_pretrained(tmp_path / name)
        adapters[name] = str(tmp_path / name)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()
               for n in (3, 19)]
    expected = _lora_run(str(tmp_path / "m"), adapters, 1, prompts, monkeypatch)
    got = _lora_run(str(tmp_path / "m"), adapters, 2, prompts, monkeypatch)
    assert got.keys() == expected.keys()
    for rid, want in expected.items():
        assert got[rid]["tokens"] == want["tokens"], rid
        np.testing.assert_allclose(np.stack(got[rid]["logprobs"]), np.stack(want["logprobs"]),
                                   atol=1e-4, rtol=0, err_msg=rid)
    for i in range(len(prompts)):  # each adapter changes the model
        base_lp = expected[f"1:None-{i}"]["logprobs"][0]
        for name in "ab":
            assert np.abs(expected[f"1:{name}-{i}"]["logprobs"][0] - base_lp).max() > 1e-3


def _word_tokenizer(ids: dict[str, int]):
    """A word-level tokenizer whose words have the given ids (gaps allowed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel(ids, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@SLOW
def test_a_yes_no_reranker_at_two_ranks_scores_as_transformers(tmp_path):
    """--hf-overrides' yes/no head (Qwen3-Reranker) over 2 ranks: "no" (id 5) lies in rank
    0's half of the vocabulary, "yes" (id 100) in rank 1's, so the head's row difference is
    put together from both ranks' parts. Scores: the one-rank engine's, and transformers'
    sigmoid(last hidden . (E[yes] - E[no])) (the embedder's LM head is its embedding)."""
    model = build_embedder(str(tmp_path))
    _word_tokenizer({"<unk>": 0, "no": 5, "yes": 100}).save_pretrained(tmp_path)
    overrides = json.dumps({"architectures": ["Qwen3ForSequenceClassification"],
                            "classifier_from_token": ["no", "yes"],
                            "is_original_qwen3_reranker": True})
    prompts = [[5, 9, 10], list(range(4, 13)) * 3, [7], [100, 3, 64, 65]]
    scores = {}
    for ranks in (1, 2):
        core = build_engine(msgspec.structs.replace(
            _config(str(tmp_path), ranks), max_model_len=48, runner="pooling",
            hf_overrides=overrides))
        try:
            for i, ids in enumerate(prompts):
                core.add(EngineRequest(f"s{i}", pack_ids(ids), SamplingParams(max_tokens=1),
                                       "tcp://test", 0.0, pooling=PoolingParams(task="score")))
            outs = {}
            while core.has_work:
                outs.update((o.request_id, o) for _, o in core.step())
        finally:
            if ranks > 1:
                assert core.runner.model.inner.tp.size == 2
                core.runner.model.close()
        assert all(outs[f"s{i}"].error is None for i in range(len(prompts)))
        scores[ranks] = np.array([float(unpack_tensor(outs[f"s{i}"].pooled).reshape(-1)[0])
                                  for i in range(len(prompts))])
    embed = model.embed_tokens.weight.detach()
    want = np.array([float(torch.sigmoid(reference_vector(model, ids, normalize=False)
                                         @ (embed[100] - embed[5]))) for ids in prompts])
    np.testing.assert_allclose(scores[1], want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(scores[2], scores[1], atol=1e-6, rtol=0)
    assert np.ptp(want) > 0.05  # the prompts score differently: not one constant answer


# --- a GGUF's quantized blocks, cut per rank ------------------------------------------------------

# Hidden 256, intermediate 512, 4 heads, 2 KV heads; a vocabulary of 251 rows, 126 a rank
# at 2 ranks: rank 1's part of the embedding and the LM head is padded with a zero row.
GGUF_SHAPE = LlamaShape(vocab=251)
# Layer 0: Q8_0 attention, Q4_1 MLP (32-weight blocks: every cut at 2 ranks on a boundary).
# Layer 1: Q4_K_M's mix (256-weight blocks): Q4_K with Q6_K v (q/k/v of mixed kinds) and down;
# its o_proj's input (256) halves to 128, inside a block: that weight stays dense at 2 ranks,
# while down_proj's (512) halves to 256, a whole block.
GGUF_KINDS = {
    **{f"blk.0.attn_{x}.weight": "Q8_0" for x in ("q", "k", "v", "output")},
    **{f"blk.0.ffn_{x}.weight": "Q4_1" for x in ("gate", "up", "down")},
    "blk.1.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K", "output.weight": "Q6_K",
}
OFF_BLOCK = "model.layers.1.self_attn.o_proj.weight"  # its 2-rank cut falls inside a block


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-tp")
    path = str(folder / "tiny-mixed.gguf")
    write_q4_k_m(path, GGUF_SHAPE, set(), kinds=GGUF_KINDS)
    # The file has no vocabulary: --tokenizer FOLDER (a folder with a config.json).
    tiny_vlm_tokenizer().save_pretrained(folder / "tokenizer")
    (folder / "tokenizer" / "config.json").write_text("{}")
    return path


def test_each_rank_reads_only_its_blocks_of_a_gguf(gguf_file):
    """Each rank's blocks of every quantized matrix, dequantized, are exactly its slice of
    the dense weights (q/k un-permuted after the cut; the vocabulary's padding row zero
    bytes, which read as zero weights); the ranks' blocks together are the file's bytes
    (plus the padding row), and a row-parallel weight whose cut falls inside a block is
    left to its dense slice. The rank's dense weights, dequantized from only the blocks its
    part lies in (whole blocks, then narrowed), are its slices of the whole ones."""
    config = load_model_config(gguf_file)
    dense = load_weights(gguf_file, config, torch.float32)
    whole = load_quantized_weights(gguf_file, config)
    kinds = {v: gguf.GGMLQuantizationType[k] for k, v in BLOCK_KINDS.items()}
    held = {}
    for rank in range(2):
        shard = Shard.of(config, rank, 2)
        part = load_weights(gguf_file, config, torch.float32, shard=shard)
        assert part.keys() == dense.keys()
        for name, tensor in part.items():
            assert torch.equal(tensor, shard.take(name, dense[name])), name
        blocks = load_quantized_weights(gguf_file, config, shard)
        assert set(whole) - set(blocks) == {OFF_BLOCK}
        for name, q in blocks.items():
            got = gguf.quants.dequantize(q.blocks.numpy(), kinds[q.kind])
            assert np.array_equal(got, shard.take(name, dense[name]).numpy()), name
            held[name] = held.get(name, 0) + q.blocks.numel()
    for name, count in held.items():
        rows, width = whole[name].blocks.shape
        padding = width if name in ("model.embed_tokens.weight", "lm_head.weight") else 0
        assert count == rows * width + padding, name


def test_a_moe_gguf_rank_dequantizes_only_its_part_of_each_expert(tmp_path):
    """A Qwen2-MoE GGUF (llama.cpp's stacked experts, a shared expert): each rank's experts,
    cut from the stacked tensors one expert at a time, are its slices of the whole ones."""
    config_cls, model_cls, overrides, ranks = CASES["qwen2_moe"]
    hf = config_cls(**{**TINY, **overrides})
    model = model_cls._from_config(hf).to(torch.float32)
    _randomize(model, seed=4)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    path = str(tmp_path / "tiny-qwen2moe.gguf")
    write_family_gguf(str(tmp_path / "hf"), path, hf, "qwen2moe")
    config = load_model_config(path)
    dense = load_weights(path, config, torch.float32)
    assert any(".experts." in name for name in dense)
    for rank in range(ranks):
        shard = Shard.of(config, rank, ranks)
        part = load_weights(path, config, torch.float32, shard=shard)
        assert part.keys() == dense.keys()
        for name, tensor in part.items():
            assert torch.equal(tensor, shard.take(name, dense[name])), name


def test_a_gguf_at_two_ranks_decodes_through_its_blocks_as_one_rank(gguf_file):
    """The GGUF served at 2 ranks against 1 (the CPU kernels over the blocks at every step:
    8-row chunks): greedy tokens equal, logprobs within 1e-4; rank 0 multiplies by its
    half of each weight's blocks, every linear but layer 1's o_proj (dense, see above)."""
    from engine.kernels.cpu_kernels import enabled, kernels

    if kernels() is None:
        assert not enabled() or shutil.which("c++") is None, "the CPU kernels failed to build"
        pytest.skip("no CPU kernels here: nothing multiplies by the blocks")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, GGUF_SHAPE.vocab, (n,), generator=gen).tolist()
               for n in PROMPT_LENGTHS]
    tokenizer = os.path.join(os.path.dirname(gguf_file), "tokenizer")
    config = msgspec.structs.replace(_config(gguf_file, 1), tokenizer=tokenizer)
    single = build_engine(config)
    expected = _serve(single, prompts)
    core = build_engine(msgspec.structs.replace(config, tensor_parallel_size=2))
    try:
        got = _serve(core, prompts)
        rank0 = core.runner.model.inner
    finally:
        core.runner.model.close()
    one = single.runner.model
    names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
    pairs = [(getattr(a, n), getattr(b, n)) for a, b in zip(one.layers, rank0.layers, strict=True)
             for n in names] + [(one.lm_head, rank0.lm_head)]
    for i, (whole, half) in enumerate(pairs):
        whole_q = one.ops._quantized[id(whole)]
        half_q = rank0.ops._quantized.get(id(half))
        if i == len(names) + 1:  # layer 1's o_proj
            assert half_q is None
        elif i < len(pairs) - 1:
            assert 2 * half_q.blocks.numel() == whole_q.blocks.numel(), i
        else:  # the LM head: 126 of 251 rows (rank 1's 125 and a padding row)
            assert half_q.blocks.shape[0] == 126 and whole_q.blocks.shape[0] == 251
    for rid, want in expected.items():
        assert got[rid]["tokens"] == want["tokens"], rid
        np.testing.assert_allclose(np.stack(got[rid]["logprobs"]),
                                   np.stack(want["logprobs"]), atol=1e-4, rtol=0)
    assert len({tuple(r["tokens"]) for r in expected.values()}) > 2  # not one answer


# --- the slicing and the refusals, without processes ---------------------------------------------


def _small_config(**fields):
    return msgspec.structs.replace(CONFIG, **fields)


@pytest.mark.parametrize("module, width, out", [
    ("q_proj", 32, 16), ("k_proj", 32, 8), ("v_proj", 32, 8), ("qkv_proj", 32, 32),
    ("gate_proj", 32, 37), ("up_proj", 32, 37), ("gate_up_proj", 32, 74),
    ("o_proj", 16, 32), ("down_proj", 37, 32)])
def test_adapter_slices_give_each_rank_its_part_of_the_product(module, width, out):
    """engine.step.lora_adapters's slices at 2 ranks (4 heads of 4, 1 KV head: replicated; an odd
    intermediate: padded): on a column-parallel module each rank's x A_r^T B_r^T is its
    rows of the whole product, as the base weight's rows are; on a row-parallel one the
    ranks' products over their input columns sum to the whole."""
    a, b, x = torch.randn(3, width), torch.randn(out, 3), torch.randn(5, width)
    whole = x @ a.T @ b.T
    block = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
    name = f"model.layers.0.{block}.{module}.weight"
    shards = [Shard(r, 2, 4, 1, 4) for r in range(2)]
    if module in ("o_proj", "down_proj"):
        attr = "o_weight" if module == "o_proj" else "down_weight"
        parts = [engine_lora._slice(sh, 0, module, attr, a, b) for sh in shards]
        assert all(torch.equal(pb, b) and pa.shape[1] == sh.local_shape(name, (out, width))[1]
                   for sh, (pa, pb) in zip(shards, parts, strict=True))  # B whole, A cut
        total = sum(sh.take(name, x) @ pa.T @ pb.T
                    for sh, (pa, pb) in zip(shards, parts, strict=True))
        torch.testing.assert_close(total, whole)
    else:
        attr = "qkv_weight" if block == "self_attn" else "gate_up_weight"
        for sh in shards:
            pa, pb = engine_lora._slice(sh, 0, module, attr, a, b)
            # A whole, B's rows as the base weight's (a replicated KV head's: all of them)
            assert torch.equal(pa, a) and pb.shape[0] == sh.local_shape(name, (out, width))[0]
            torch.testing.assert_close(x @ pa.T @ pb.T, sh.take(name, whole.T).T)


def test_shards_put_back_together_give_the_tensor():
    """Column parts stack to the whole, padded parts carry zeros only, replicated KV heads
    follow the query heads that use them."""
    full = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)  # a 7-token vocabulary
    parts = [Shard(r, 3, 6, 3, 1).take("model.embed_tokens.weight", full) for r in range(3)]
    assert [p.shape[0] for p in parts] == [3, 3, 3]
    assert torch.equal(torch.cat(parts)[:7], full) and not torch.cat(parts)[7:].any()
    down = torch.randn(4, 10)  # [hidden, intermediate 10] over 3 ranks: 4 + 4 + 2 (+2 zeros)
    cols = [Shard(r, 3, 6, 3, 1).take("model.layers.0.mlp.down_proj.weight", down)
            for r in range(3)]
    assert torch.equal(torch.cat(cols, dim=1)[:, :10], down)
    k = torch.arange(2 * 4, dtype=torch.float32).view(2 * 4, 1)  # 2 KV heads of head_dim 4
    held = [Shard(r, 4, 8, 2, 4).take("model.layers.0.self_attn.k_proj.weight", k)
            for r in range(4)]
    assert [int(h[0, 0]) for h in held] == [0, 0, 4, 4]  # ranks 0,1: head 0; 2,3: head 1
    # Phi-3's fused qkv_proj (2 heads, 1 KV head, head_dim 2) over 2 ranks: each holds its
    # query head and the one KV head's k and v rows; gate_up_proj: its half of each part.
    qkv = torch.arange(2 * 2 + 2 * 2, dtype=torch.float32).view(8, 1)  # q0 q0 q1 q1 k k v v
    held = [Shard(r, 2, 2, 1, 2).take("model.layers.0.self_attn.qkv_proj.weight", qkv)
            for r in range(2)]
    assert [h.flatten().tolist() for h in held] == [[0, 1, 4, 5, 6, 7], [2, 3, 4, 5, 6, 7]]
    gate_up = torch.arange(2 * 3, dtype=torch.float32).view(6, 1)  # gate 0-2, up 3-5
    held = [Shard(r, 2, 2, 2, 1).take("model.layers.0.mlp.gate_up_proj.weight", gate_up)
            for r in range(2)]
    assert [h.flatten().tolist() for h in held] == [[0, 1, 3, 4], [2, 0, 5, 0]]
    # gpt-oss: interleaved gate/up columns split by pairs (3 pairs: 2 + 1 and a zero pair);
    # a bias after a row-parallel matmul on rank 0 only; sinks with the query heads.
    stacked = torch.arange(6, dtype=torch.float32).view(1, 1, 6)  # g0 u0 g1 u1 g2 u2
    held = [Shard(r, 2, 2, 2, 1).take("model.layers.0.mlp.experts.gate_up_proj", stacked)
            for r in range(2)]
    assert [h.flatten().tolist() for h in held] == [[0, 1, 2, 3], [4, 5, 0, 0]]
    bias = torch.rand(1, 4)
    held = [Shard(r, 2, 2, 2, 1).take("model.layers.0.mlp.experts.down_proj_bias", bias)
            for r in range(2)]
    assert torch.equal(held[0], bias) and not held[1].any() and held[1].shape == bias.shape
    sinks = torch.arange(4.0)
    assert Shard(1, 2, 4, 2, 1).take("model.layers.0.self_attn.sinks", sinks).tolist() == [2, 3]
    # Replicated: whole, but a copy (no view keeps the checkpoint's mapping alive).
    for name, whole in (("model.layers.0.input_layernorm.weight", torch.rand(4)),
                        ("model.layers.0.mlp.gate.weight", torch.rand(4, 8)),
                        ("model.layers.0.self_attn.q_norm.weight", torch.rand(4))):
        held = Shard(1, 2, 4, 2, 4).take(name, whole)
        assert torch.equal(held, whole) and held.data_ptr() != whole.data_ptr(), name


def test_mxfp4_experts_sliced_then_dequantized_are_the_dense_slices():
    """gpt-oss's MXFP4 experts: a rank's slice of the blocks and scales dequantizes to its
    slice of the dense experts (which the family cases check end to end)."""
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter = 2, 64, 128  # inter: 4 blocks of 32, 2 per rank
    for name, rows, width in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        blocks = torch.randint(0, 256, (experts, rows, width // 32, 16), generator=gen)
        scales = torch.randint(120, 130, (experts, rows, width // 32), generator=gen)
        dense = dequantize_mxfp4(blocks.float(), scales.float())
        stem = f"model.layers.0.mlp.experts.{name}"
        for rank in range(2):
            shard = Shard(rank, 2, 4, 2, 16)
            local = dequantize_mxfp4(shard.take(stem + "_blocks", blocks.float()),
                                     shard.take(stem + "_scales", scales.float()))
            assert torch.equal(local, shard.take(stem, dense)), (name, rank)


@pytest.mark.parametrize("fields, ranks, match", [
    (dict(num_heads=4, num_kv_heads=2), 3, "4 attention heads do not divide into 3"),
    (dict(num_heads=6, num_kv_heads=4), 3, "4 KV heads neither divide"),
    (dict(architecture="bert"), 2, "bert family is not sharded"),
    (dict(architecture="llama", multimodal="qwen2_vl"), 2, "qwen2_vl family is not sharded"),
    (dict(architecture="gpt_oss", family_options=GptOssOptions(1.7, 7.0, mxfp4=True),
          moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=96)), 2,
     "96 is 3 MXFP4 blocks of 32, which do not divide into 2"),
])
def test_unsplittable_models_are_refused(fields, ranks, match):
    with pytest.raises(StartupError, match=match):
        check_tensor_parallel(_small_config(**fields), ranks)


@pytest.mark.parametrize("kwargs, environ, match", [
    (dict(tensor_parallel_size=4, nnodes=3), {}, "4 does not divide into --nnodes 3"),
    (dict(tensor_parallel_size=4, nnodes=2), {}, "needs --master-addr"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), {}, "--node-rank 2 is not within"),
    (dict(tensor_parallel_size=1, nnodes=2, master_addr="h"), {}, "nothing to spread"),
    (dict(tensor_parallel_size=2), dict(WORLD_SIZE="4", RANK="0"), "WORLD_SIZE=4"),
    (dict(tensor_parallel_size=2), dict(WORLD_SIZE="2", RANK="1"), "MASTER_ADDR"),
])
def test_bad_rendezvous_is_refused(kwargs, environ, match):
    with pytest.raises(StartupError, match=match):
        plan_rendezvous(**kwargs, environ=environ)


def test_rendezvous_places():
    node1 = plan_rendezvous(4, nnodes=2, node_rank=1, master_addr="head", environ={})
    assert (node1.rank, node1.spawn, node1.master_port) == (2, (3,), 29500)
    env = dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="0", MASTER_ADDR="a", MASTER_PORT="7")
    torchrun = plan_rendezvous(2, environ=env)
    assert (torchrun.rank, torchrun.spawn, torchrun.master_port) == (1, (), 7)
    assert plan_rendezvous(1, environ={}) is None


@pytest.mark.parametrize("argv, message", [
    (["-tp", "0"], "0 is below the minimum, 1"),
    (["--nnodes", "0"], "0 is below the minimum, 1"),
    (["--node-rank", "-1"], "-1 is below the minimum, 0"),
    (["--master-port", "70000"], "70000 is above the maximum"),
    (["-tp", "two"], "not an integer"),
])
def test_flag_values_are_bounded(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


def test_flags_reach_the_engine_and_serve_forwards_them(monkeypatch):
    argv = ["-tp", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "head",
            "--master-port", "29501"]
    config = cli.engine_config(cli.parse_args(["engine", *argv]), "ipc:///tmp/x")
    assert (config.tensor_parallel_size, config.nnodes, config.node_rank, config.master_addr,
            config.master_port) == (4, 2, 1, "head", 29501)
    started = []
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv, **kwargs: started.append(argv))
    monkeypatch.setattr(cli, "_supervise", lambda children, **kwargs: 0)
    cli._serve(cli.parse_args(["serve", "-tp", "3"]))
    engine = next(a for a in started if "engine" in a)
    assert engine[engine.index("--tensor-parallel-size") + 1] == "3"


@SLOW
def test_two_nodes_meet_over_the_documented_rendezvous(tmp_path):
    """`--nnodes 2`: node 1 is a separate `sluice engine --node-rank 1` process (as on
    another machine), node 0 is the engine here; they meet at --master-addr:--master-port
    over loopback and serve the one-rank tokens. Node 1 exits 0 when the engine closes."""
    config_cls, model_cls, overrides, _ = CASES["llama-kv-split"]
    model = model_cls._from_config(config_cls(**{**TINY, **overrides}))
    _randomize(model, seed=8)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tiny_vlm_tokenizer().save_pretrained(tmp_path)
    path, port = str(tmp_path), free_tcp_port()
    prompts = [[5, 6, 7], list(range(20, 40))]
    expected = _serve(build_engine(_config(path, 1)), prompts)
    node1 = subprocess.Popen(
        [sys.executable, "-m", "sluice", "engine", "--model", path, "-tp", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(port), "--dtype", "float32", "--attention-backend", "torch", "--threads", "1",
         "--num-kv-pages", "64", "--page-size", "4", "--max-num-batched-tokens", "8"])
    try:
        core = build_engine(msgspec.structs.replace(
            _config(path, 2), nnodes=2, node_rank=0, master_addr="127.0.0.1",
            master_port=port))
        assert core.runner.model.procs == []  # node 0 runs one rank: itself
        got = _serve(core, prompts)
        core.runner.model.close()
        assert node1.wait(timeout=30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert {k: v["tokens"] for k, v in got.items()} == {
        k: v["tokens"] for k, v in expected.items()}


def test_a_collective_that_fails_on_a_lost_rank_names_it(monkeypatch):
    """A peer's death can reach a collective before the watchdog's next look: the engine
    then stops with the same line naming the rank. A collective that gives up on a rank
    (its timeout) names the rank started here that is stopped, or says it timed out. With
    every rank alive and running, another error goes on as it is."""
    from engine.parallel import leader

    stopped = []
    monkeypatch.setattr(leader, "_stop_engine", lambda why, procs: stopped.append(why))
    monkeypatch.setattr(leader, "REAP_WAIT_S", 0.2)  # each alive case waits this long

    def fails(message):
        def collective():
            raise RuntimeError(message)
        return collective

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RuntimeError, match="closed by peer"):
            leader.collective([(1, alive)], fails("Connection closed by peer"))
        assert stopped == []
        with pytest.raises(RuntimeError):  # a timeout, every rank here running: elsewhere
            leader.collective([(1, alive)], fails("Timed out waiting 3000ms for recv"))
        assert "collective timed out after" in stopped.pop()
        os.kill(alive.pid, signal.SIGSTOP)
        wait_until(lambda: leader._stopped_ranks([(1, alive)]) == [1], 10, "the stop")
        with pytest.raises(RuntimeError):
            leader.collective([(2, alive)], fails("Timed out waiting 3000ms for recv"))
        assert stopped.pop().startswith("tensor-parallel rank 2 is stopped")
    finally:
        alive.kill()
        alive.wait()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError):
        leader.collective([(1, dead)], fails("Connection closed by peer"))
    assert stopped == ["tensor-parallel rank 1 exited (code 3)"]
    assert leader.collective([(1, dead)], lambda: 7) == 7


def test_watchdog_reports_a_rank_that_exits():
    lost = []
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dog = Watchdog([(1, proc)], on_lost=lambda rank, code: lost.append((rank, code)))
    dog.thread.join(timeout=30)
    assert lost == [(1, 3)]
