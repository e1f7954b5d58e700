"""vLLM's cross-encoder routes end to end: `sluice serve` on a tiny random
BertForSequenceClassification with one label and a WordPiece tokenizer (tests/tiny_bert.py),
raw HTTP, scores compared with transformers' sigmoid of the logit in float32; and bad input
a clear 400. One server for the module."""

import httpx
import pytest
import torch

from tests.servers import Stack
from tests.tiny_bert import build_cross_encoder, reference_logits

MAX_INPUTS = 5
QUERY = "hello world"
DOCS = ["the cat sat on the mat", "hi there", "a big dog runs . a small cat",
        "hello world hello"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("cross-encoder")
    tokenizer, model = build_cross_encoder(str(path))
    s = Stack(str(tmp_path_factory.mktemp("rerank-serve")), "--model", str(path),
              "--served-model-name", "tiny-rerank", "--device", "cpu", "--dtype", "float32",
              "--max-model-len", "40", "--num-kv-pages", "32", "--page-size", "4",
              "--max-embedding-inputs", str(MAX_INPUTS))
    yield s.base_url, tokenizer, model
    s.stop()


def _expected(server, a: str, b: str) -> float:
    return float(torch.sigmoid(reference_logits(server[1], server[2], a, b))[0])


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server[0]}{path}", json=body, timeout=60)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_one_to_many_and_pairwise(server, path):
    out = _post(server, path, {"model": "tiny-rerank", "text_1": QUERY, "text_2": DOCS}).json()
    assert out["object"] == "list" and out["model"] == "tiny-rerank"
    assert [d["index"] for d in out["data"]] == list(range(len(DOCS)))
    for doc, item in zip(DOCS, out["data"], strict=True):
        assert item["object"] == "score"
        assert abs(item["score"] - _expected(server, QUERY, doc)) < 1e-4
    tokens = sum(len(server[1](QUERY, d)["input_ids"]) for d in DOCS)
    assert out["usage"]["prompt_tokens"] == tokens
    zipped = _post(server, path, {"text_1": ["hi", "hello"], "text_2": DOCS[:2]}).json()
    assert abs(zipped["data"][1]["score"] - _expected(server, "hello", DOCS[1])) < 1e-4


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_best_first_top_n_and_documents(server, path):
    out = _post(server, path, {"model": "tiny-rerank", "query": QUERY, "documents": DOCS}).json()
    scores = [_expected(server, QUERY, d) for d in DOCS]
    best_first = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    assert [r["index"] for r in out["results"]] == best_first
    for r in out["results"]:
        assert abs(r["relevance_score"] - scores[r["index"]]) < 1e-4
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert out["usage"]["total_tokens"] > 0 and out["model"] == "tiny-rerank"
    top = _post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 2,
                               "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == best_first[:2]
    assert all("document" not in r for r in top["results"])


def test_classify_gives_label_probabilities(server):
    """One label: the sigmoid of its logit, as transformers' logit gives it (vLLM's), not a
    softmax over one logit (always 1)."""
    texts = ["hello world", "hi"]
    out = _post(server, "/classify", {"input": texts}).json()
    assert [d["index"] for d in out["data"]] == [0, 1]
    for text, d in zip(texts, out["data"], strict=True):
        expected = float(torch.sigmoid(reference_logits(server[1], server[2], text))[0])
        assert d["label"] == "class_0" and d["num_classes"] == 1
        assert abs(d["probs"][0] - expected) < 1e-4 and abs(expected - 1.0) > 1e-3


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/score", {"text_1": "", "text_2": "hi"}, "text_1"),
    ("/score", {"text_1": "hi", "text_2": []}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/score", {"text_1": "hi", "text_2": [1, 2]}, "text_2"),
    ("/score", {"text_1": "hi", "text_2": ["x"] * (MAX_INPUTS + 1)}, "text_2"),
    ("/score", {"text_1": "hi", "text_2": " ".join(["hello"] * 60)}, "text_2"),
    ("/score", {"text_1": "hi", "text_2": "x", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("/score", {"text_1": "hi"}, None),
    ("/rerank", {"query": "", "documents": ["x"]}, "query"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["x", None]}, "documents"),
    ("/rerank", {"query": "q", "documents": ["x"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "q", "documents": "x"}, None),
    ("/classify", {"input": []}, "input"),
    ("/classify", {"input": [""]}, "input"),
    ("/classify", {"input": "x", "extra": 1}, None),
])
def test_bad_input_is_a_400(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_long_pairs_truncate_when_asked_and_embeddings_are_refused(server):
    long_doc = " ".join(["hello"] * 60)
    out = _post(server, "/score", {"text_1": "hi", "text_2": long_doc,
                                   "truncate_prompt_tokens": -1}).json()
    assert out["usage"]["prompt_tokens"] == 40 and 0 < out["data"][0]["score"] < 1
    r = _post(server, "/v1/embeddings", {"input": "hi"})
    assert r.status_code == 400 and "not served by this model" in r.json()["error"]["message"]


def _reference_cut(server, a: str, b: str | None, keep: int) -> tuple[int, float]:
    """transformers' own truncation of a pair to `keep` tokens (longest_first, separators
    kept), its token count and the sigmoid of its logit."""
    enc = server[1](a, b, truncation=True, max_length=keep, return_tensors="pt",
                    return_token_type_ids=True)
    with torch.no_grad():
        logit = server[2](**enc).logits[0]
    return enc["input_ids"].shape[1], float(torch.sigmoid(logit)[0])


def test_truncated_pairs_keep_their_second_segment_and_separator(server):
    """A cut pair is the tokenizer's own cut: text from the longer segment, both [SEP]s kept
    (a plain slice of the joined ids dropped the closing [SEP] and then the whole document)."""
    long_query = " ".join(["hello"] * 30)
    for a, b, keep in [(long_query, "hi there", 9), (long_query, " ".join(["cat"] * 50), 40),
                       ("hi", " ".join(["hello"] * 60), 12)]:
        out = _post(server, "/score", {"text_1": a, "text_2": b,
                                       "truncate_prompt_tokens": keep}).json()
        count, expected = _reference_cut(server, a, b, keep)
        assert out["usage"]["prompt_tokens"] == count == keep
        assert abs(out["data"][0]["score"] - expected) < 1e-4
    rerank = _post(server, "/rerank", {"query": long_query, "documents": ["hi there"],
                                       "truncate_prompt_tokens": 9}).json()
    assert abs(rerank["results"][0]["relevance_score"]
               - _reference_cut(server, long_query, "hi there", 9)[1]) < 1e-4
    long_text = " ".join(["dog"] * 80)
    classify = _post(server, "/classify", {"input": long_text,
                                           "truncate_prompt_tokens": 10}).json()
    count, expected = _reference_cut(server, long_text, None, 10)
    assert classify["usage"]["prompt_tokens"] == count == 10
    assert abs(classify["data"][0]["probs"][0] - expected) < 1e-4


def test_pair_budgets_ceiling_cut_and_bounds(server):
    """The character ceiling (40 tokens x the longest token's characters) pre-cuts a huge
    truncated pair before the tokenizer sees it; untruncated it is a 400 at once; a keep
    too small for the separators is a 400 naming the field."""
    from tests.servers import metrics

    huge = "hello " * 20_000
    before = metrics(server[0])["sluice:input_tokenizer_chars_total"]
    out = _post(server, "/score", {"text_1": huge, "text_2": huge,
                                   "truncate_prompt_tokens": -1})
    assert out.status_code == 200 and out.json()["usage"]["prompt_tokens"] == 40
    tokenized = metrics(server[0])["sluice:input_tokenizer_chars_total"] - before
    assert 0 < tokenized < len(huge)  # each side cut to the ceiling
    r = _post(server, "/rerank", {"query": "hi", "documents": [huge]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    assert "characters" in r.json()["error"]["message"]
    for keep, status in [(2, 400), (3, 200), (40, 200), (41, 400)]:
        r = _post(server, "/score", {"text_1": "hi", "text_2": "hello world",
                                     "truncate_prompt_tokens": keep})
        assert r.status_code == status, (keep, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == "truncate_prompt_tokens"
    r = _post(server, "/classify", {"input": "hi", "truncate_prompt_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
