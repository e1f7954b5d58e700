"""An uncased encoder saved as sentence-transformers saves it: a tokenizer that keeps case and
`do_lower_case: true` in sentence_bert_config.json. `sluice serve` lowercases the input
(after the character ceiling, before tokenizing), so /v1/embeddings equals
sentence-transformers' own `encode`; without it, capitalized words were [UNK]."""

import httpx
import numpy as np
import pytest

from tests.servers import Stack
from tests.tiny_bert import build_bert
from tests.tiny_embedder import cosine

TEXTS = ["Hello World", "THE CAT SAT ON THE MAT", "hi there"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("uncased-bert")
    tokenizer = build_bert(str(path), do_lower_case=True)
    assert "[UNK]" in tokenizer.tokenize("Hello")  # the tokenizer alone keeps case
    s = Stack(str(tmp_path_factory.mktemp("uncased-serve")), "--model", str(path),
              "--device", "cpu", "--dtype", "float32", "--max-model-len", "24",
              "--num-kv-pages", "32", "--page-size", "4")
    yield s, str(path)
    s.stop()


def test_embeddings_equal_sentence_transformers_lowercasing(server):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(server[1], device="cpu").encode(
        TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    out = httpx.post(f"{server[0].base_url}/v1/embeddings",
                     json={"input": TEXTS, "encoding_format": "float"}, timeout=60).json()
    for item, theirs in zip(out["data"], reference, strict=True):
        assert cosine(item["embedding"], theirs) > 0.9999
        assert np.allclose(item["embedding"], theirs, atol=1e-5)
    # Lowercased, "Hello World" is the 4 tokens "[CLS] hello world [SEP]", as for "hello world".
    lower = httpx.post(f"{server[0].base_url}/v1/embeddings",
                       json={"input": "hello world", "encoding_format": "float"}).json()
    assert np.allclose(lower["data"][0]["embedding"], out["data"][0]["embedding"], atol=1e-6)
    assert lower["usage"]["prompt_tokens"] == 4
