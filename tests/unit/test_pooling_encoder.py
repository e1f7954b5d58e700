"""The encoder family (engine.models.bert) on the pooling runner: tiny random BERT and
XLM-RoBERTa checkpoints with a WordPiece tokenizer (tests/tiny_bert.py), saved as
sentence-transformers models, served by build_engine's EngineCore and compared with
sentence-transformers' `encode` in float32, single and batched with mixed lengths."""

import numpy as np
import pytest

from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.protocol import EngineRequest, PoolingParams, SamplingParams, pack_ids, unpack_tensor
from shared.runner_config import PoolerConfig, pooling_facts, resolve_runner
from shared.startup_checks import StartupError
from tests.tiny_bert import build_bert, build_cross_encoder, reference_logits
from tests.tiny_embedder import cosine

TEXTS = ["hello world", "the cat sat on the mat . the dog runs", "hi",
         "a big dog , a small cat , hello there world the mat"]


def _core(path: str, **extra):
    return build_engine(EngineConfig(
        model=path, served_model_name="bert", request_address="inproc://b", device="cpu",
        dtype="float32", page_size=4, num_pages=32, max_num_batched_tokens=16, **extra))


def _embed(core, prompts: list[list[int]]) -> list[np.ndarray]:
    for i, ids in enumerate(prompts):
        core.add(EngineRequest(f"r{i}", pack_ids(ids), SamplingParams(max_tokens=1),
                               "inproc://x", 0.0, pooling=PoolingParams()))
    outs = {}
    while core.has_work:
        for _, out in core.step():
            outs[out.request_id] = out
    assert all(o.error is None for o in outs.values()), outs
    assert core.allocator.num_free == core.allocator.num_pages and not core.sequences
    return [unpack_tensor(outs[f"r{i}"].pooled) for i in range(len(prompts))]


@pytest.mark.parametrize(("kind", "pooling", "expected"), [
    ("bert", "mean", PoolerConfig("MEAN", True)),
    ("xlm-roberta", "cls", PoolerConfig("CLS", True)),
])
def test_encoder_matches_sentence_transformers(tmp_path, kind, pooling, expected):
    from sentence_transformers import SentenceTransformer

    tokenizer = build_bert(str(tmp_path), kind, pooling)
    assert resolve_runner(str(tmp_path)) == "pooling"
    assert pooling_facts(str(tmp_path)).pooler == expected
    reference = SentenceTransformer(str(tmp_path), device="cpu").encode(
        TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    core = _core(str(tmp_path))
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    batched = _embed(core, prompts)
    assert core.max_seqs_in_step >= 2  # mixed lengths shared steps
    alone = _embed(core, prompts[1:2])
    for ours, theirs in zip(batched, reference, strict=True):
        assert cosine(ours, theirs) > 0.9999
        assert np.allclose(ours, theirs, atol=1e-5)
    assert np.allclose(alone[0], batched[1], atol=1e-6)


def test_an_encoder_cannot_generate(tmp_path):
    build_bert(str(tmp_path))
    with pytest.raises(StartupError, match="--runner pooling"):
        _core(str(tmp_path), runner="generate")
    with pytest.raises(StartupError, match="longer than this encoder's 64 positions"):
        _core(str(tmp_path), max_model_len=65)


def test_one_label_classify_and_score_are_the_sigmoid(tmp_path):
    """vLLM's: below two labels both tasks take the sigmoid (a softmax over one logit would
    answer 1.0 whatever the model said)."""
    tokenizer, model = build_cross_encoder(str(tmp_path), num_labels=1)
    core = _core(str(tmp_path))
    texts = ["hello world", "the cat sat on the mat"]
    for task in ("classify", "score"):
        for i, text in enumerate(texts):
            enc = tokenizer(text, return_token_type_ids=True)
            core.add(EngineRequest(f"{task}{i}", pack_ids(enc["input_ids"]),
                                   SamplingParams(max_tokens=1), "inproc://x", 0.0,
                                   pooling=PoolingParams(
                                       task=task, token_type_ids=pack_ids(enc["token_type_ids"]))))
    outs = {}
    while core.has_work:
        for _, out in core.step():
            outs[out.request_id] = out
    for task in ("classify", "score"):
        for i, text in enumerate(texts):
            probs = unpack_tensor(outs[f"{task}{i}"].pooled)
            expected = reference_logits(tokenizer, model, text).sigmoid().numpy()
            assert abs(float(expected[0]) - 1.0) > 1e-3  # a value a softmax cannot give
            assert np.allclose(probs, expected, atol=1e-5), (task, probs, expected)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_cross_encoder_classify_and_score_match_transformers(tmp_path, kind):
    tokenizer, model = build_cross_encoder(str(tmp_path), kind, num_labels=3)
    facts = pooling_facts(str(tmp_path))
    assert facts.tasks == ("classify", "score") and facts.labels == ["class_0", "class_1",
                                                                      "class_2"]
    core = _core(str(tmp_path))
    pairs = [("hello world", "the cat sat on the mat"), ("hi", "a big dog . hello there")]
    for task in ("classify", "score"):
        for i, (a, b) in enumerate(pairs):
            enc = tokenizer(a, b, return_token_type_ids=True)
            types = enc["token_type_ids"] if kind == "bert" else [0] * len(enc["input_ids"])
            core.add(EngineRequest(f"{task}{i}", pack_ids(enc["input_ids"]),
                                   SamplingParams(max_tokens=1), "inproc://x", 0.0,
                                   pooling=PoolingParams(task=task,
                                                         token_type_ids=pack_ids(types))))
    outs = {}
    while core.has_work:
        for _, out in core.step():
            outs[out.request_id] = out
    for task in ("classify", "score"):  # three labels: both are the softmax (vLLM's)
        for i, (a, b) in enumerate(pairs):
            probs = unpack_tensor(outs[f"{task}{i}"].pooled)
            expected = reference_logits(tokenizer, model, a, b).softmax(-1).numpy()
            assert np.allclose(probs, expected, atol=1e-5), (task, probs, expected)
    # An embedding request, or token types past the model's, are refused.
    core.add(EngineRequest("e", pack_ids([2, 5, 3]), SamplingParams(max_tokens=1),
                           "inproc://x", 0.0, pooling=PoolingParams()))
    core.add(EngineRequest("t", pack_ids([2, 5, 3]), SamplingParams(max_tokens=1),
                           "inproc://x", 0.0,
                           pooling=PoolingParams(task="score", token_type_ids=pack_ids([0, 0]))))
    outs = {o.request_id: o for _, o in core.step()}
    assert "not served by this model" in outs["e"].error
    assert "one int32 per prompt token" in outs["t"].error
