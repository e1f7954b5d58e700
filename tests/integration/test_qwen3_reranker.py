"""Qwen3-Reranker's yes/no scoring as vLLM serves it: a tiny random Qwen3ForCausalLM started
with `--hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'`, its /score and
/rerank answers compared with transformers' float32 logits: P("yes") of the softmax over the
"no" and "yes" logits at the last position, the prompt being the formatted query's tokens then
the formatted document's (vLLM's example template). One server for the module."""

import json

import httpx
import pytest
import torch
import transformers

from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.protocol import EngineRequest, PoolingParams, SamplingParams, pack_ids, unpack_tensor
from shared.runner_config import parse_hf_overrides, pooling_facts, resolve_runner
from shared.startup_checks import StartupError
from tests.servers import Stack
from tests.tiny_embedder import randomize_decoder

OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
             "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
          'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
          "<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
QUERIES = ["what is the capital of china", "explain gravity"]
DOCS = ["the capital of china is beijing", "gravity is a force that attracts two bodies",
        "beijing is a city", "a force"]


def query_text(q: str) -> str:
    return f"{PREFIX}<Instruct>: {INSTRUCT}\n<Query>: {q}\n"


def doc_text(d: str) -> str:
    return f"<Document>: {d}{SUFFIX}"


def _tokenizer():
    """Word-level, adding no special tokens (as Qwen's adds none); "yes" and "no" are
    single tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    split = pre_tokenizers.Whitespace()
    texts = [query_text(q) for q in QUERIES] + [doc_text(d) for d in DOCS] + ["yes no"]
    words = ["<unk>"] + sorted({w for t in texts for w, _ in split.pre_tokenize_str(t)})
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = split
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def _build(path: str, tied: bool = True):
    tok = _tokenizer()
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1000.0, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.Qwen3ForCausalLM._from_config(config, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    randomize_decoder(model, seed=11)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return tok, model


# Over HTTP, on a `serve` of its own (~9 s to start); the in-process checks below stay fast.
SERVED = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-reranker")
    tok, model = _build(str(path))
    s = Stack(str(tmp_path_factory.mktemp("qwen3-reranker-serve")), "--model", str(path),
              "--served-model-name", "tiny-qwen3-reranker", "--device", "cpu",
              "--dtype", "float32", "--max-model-len", "200", "--num-kv-pages", "64",
              "--page-size", "16", "--hf-overrides", json.dumps(OVERRIDES))
    yield s.base_url, tok, model
    s.stop()


def _expected(server, q: str, d: str) -> float:
    """The reference: transformers' logits at the last position, softmax over no / yes."""
    tok, model = server[1], server[2]
    ids = tok(query_text(q), doc_text(d))["input_ids"]
    with torch.no_grad():
        last = model(torch.tensor([ids])).logits[0, -1]
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    return float(torch.stack([last[no], last[yes]]).softmax(-1)[1])


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server[0]}{path}", json=body, timeout=60)


@SERVED
def test_score_is_p_yes(server):
    expected = [_expected(server, QUERIES[0], d) for d in DOCS]
    assert max(expected) - min(expected) > 1e-3  # the scores tell the documents apart
    out = _post(server, "/score", {"text_1": query_text(QUERIES[0]),
                                   "text_2": [doc_text(d) for d in DOCS]})
    assert out.status_code == 200, out.text
    got = [d["score"] for d in out.json()["data"]]
    assert got == pytest.approx(expected, abs=1e-4)
    tokens = sum(len(server[1](query_text(QUERIES[0]), doc_text(d))["input_ids"]) for d in DOCS)
    assert out.json()["usage"]["prompt_tokens"] == tokens
    pairwise = _post(server, "/v1/score", {"text_1": [query_text(q) for q in QUERIES],
                                           "text_2": [doc_text(d) for d in DOCS[:2]]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [_expected(server, q, d) for q, d in zip(QUERIES, DOCS[:2], strict=True)], abs=1e-4)


@SERVED
def test_rerank_orders_by_p_yes(server):
    out = _post(server, "/v1/rerank", {"query": query_text(QUERIES[1]),
                                       "documents": [doc_text(d) for d in DOCS], "top_n": 3})
    assert out.status_code == 200, out.text
    scores = [_expected(server, QUERIES[1], d) for d in DOCS]
    best = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:3]
    results = out.json()["results"]
    assert [r["index"] for r in results] == best
    for r in results:
        assert r["relevance_score"] == pytest.approx(scores[r["index"]], abs=1e-4)


@SERVED
def test_embeddings_refused_on_a_reranker(server):
    r = _post(server, "/v1/embeddings", {"input": "yes"})
    assert r.status_code == 400 and "not served by this model" in r.json()["error"]["message"]


@pytest.mark.parametrize(("text", "says"), [
    ("[1]", "JSON object"),
    ("{", "not JSON"),
    ('{"rope_scaling": {}}', "not supported"),
    ('{"architectures": ["Qwen3ForSequenceClassification"]}', "needs"),
    ('{"architectures": ["Qwen3ForCausalLM"], "classifier_from_token": ["no", "yes"], '
     '"is_original_qwen3_reranker": true}', "ForSequenceClassification"),
    ('{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["yes"], '
     '"is_original_qwen3_reranker": true}', "two tokens"),
    ('{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", 1],'
     ' "is_original_qwen3_reranker": true}', "two tokens"),
    ('{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", '
     '"yes"], "is_original_qwen3_reranker": false}', "must be true"),
])
def test_hf_overrides_refuses_what_it_does_not_take(text, says):
    with pytest.raises(ValueError, match=says):
        parse_hf_overrides(text)


def test_hf_overrides_makes_a_pooling_scorer(tmp_path):
    text = json.dumps(OVERRIDES)
    assert resolve_runner(str(tmp_path), "auto", text) == "pooling"
    assert resolve_runner(str(tmp_path), "generate", text) == "generate"
    facts = pooling_facts(str(tmp_path), None, text)
    assert facts.tasks == ("classify", "score") and facts.score_tokens == ["no", "yes"]
    assert facts.pooler.pooling_type == "LAST"


def _engine(path: str, overrides: dict):
    return build_engine(EngineConfig(
        model=path, served_model_name="r", request_address="inproc://r", device="cpu",
        dtype="float32", page_size=16, num_pages=32, max_model_len=200,
        hf_overrides=json.dumps(overrides)))


def test_an_untied_lm_head_scores_in_process(tmp_path):
    """Qwen3-Reranker-8B keeps its own lm_head: its rows, not the embedding's, make the head."""
    tok, model = _build(str(tmp_path), tied=False)
    core = _engine(str(tmp_path), OVERRIDES)
    ids = tok(query_text(QUERIES[0]), doc_text(DOCS[0]))["input_ids"]
    core.add(EngineRequest("a", pack_ids(ids), SamplingParams(max_tokens=1), "inproc://x", 0.0,
                           pooling=PoolingParams(task="score")))
    outs = {}
    while core.has_work:
        outs.update({out.request_id: out for _, out in core.step()})
    score = float(unpack_tensor(outs["a"].pooled).reshape(-1)[0])
    assert score == pytest.approx(_expected((None, tok, model), QUERIES[0], DOCS[0]), abs=1e-4)


def test_a_token_outside_the_vocabulary_stops_the_start(tmp_path):
    _build(str(tmp_path))
    with pytest.raises(StartupError, match="not single tokens"):
        _engine(str(tmp_path), {**OVERRIDES, "classifier_from_token": ["no", "maybe"]})
