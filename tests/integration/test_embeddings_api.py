"""/v1/embeddings end to end: `sluice serve` on a tiny Qwen3-shaped embedding checkpoint
(tests/tiny_embedder.py, picked as a pooling model from its bare `Qwen3Model`
architecture), through the official openai client and raw HTTP, compared with transformers
in float32; and every bad input a clear 400. One server for the module."""

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.servers import Stack
from tests.tiny_embedder import build_embedder, cosine, reference_vector
from tests.tiny_tokenizer import tiny_tokenizer

MAX_MODEL_LEN = 24
MAX_INPUTS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("embedder-model")
    model = build_embedder(str(path))
    s = Stack(str(tmp_path_factory.mktemp("embed-serve")), "--model", str(path),
              "--served-model-name", "tiny-embed", "--device", "cpu", "--dtype", "float32",
              "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-pages", "64",
              "--page-size", "4", "--max-num-batched-tokens", "16",
              "--max-embedding-inputs", str(MAX_INPUTS))
    yield s, model
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0].base_url}/v1", api_key="none", max_retries=0)


def _ids(text: str) -> list[int]:
    return tiny_tokenizer()(text)["input_ids"]


TEXTS = ["hello world", "hi there hello world hello world hi there", "user"]


def test_strings_batched_match_transformers(server, client):
    model = server[1]
    out = client.embeddings.create(model="tiny-embed", input=TEXTS)
    assert out.object == "list" and out.model == "tiny-embed"
    assert [d.index for d in out.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in out.data)
    for text, item in zip(TEXTS, out.data, strict=True):
        assert len(item.embedding) == 64
        assert cosine(item.embedding, reference_vector(model, _ids(text))) > 0.9999
    tokens = sum(len(_ids(t)) for t in TEXTS)
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens


def test_one_string_token_ids_and_lists_of_them(server, client):
    model = server[1]
    one = client.embeddings.create(model="tiny-embed", input="hello world",
                                   encoding_format="float")
    ids = client.embeddings.create(model="tiny-embed", input=[0, 9, 10])
    many = client.embeddings.create(model="tiny-embed", input=[[0, 9, 10], [5, 6, 7, 8]])
    # The same prompt three ways; batched with others, so equal up to float32 rounding.
    assert np.allclose(one.data[0].embedding, ids.data[0].embedding, atol=1e-6)
    assert np.allclose(one.data[0].embedding, many.data[0].embedding, atol=1e-6)
    assert cosine(many.data[1].embedding, reference_vector(model, [5, 6, 7, 8])) > 0.9999
    assert many.usage.prompt_tokens == 7


def test_base64_is_little_endian_float32(server, client):
    # The openai client asks for base64 by default and decodes it itself; raw HTTP shows the
    # wire: the same vector as the float answer, as float32 bytes.
    raw = httpx.post(f"{server[0].base_url}/v1/embeddings", json={
        "input": "hello world", "encoding_format": "base64"}).json()
    floats = client.embeddings.create(model="tiny-embed", input="hello world",
                                      encoding_format="float").data[0].embedding
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vector, floats, atol=0) and len(vector) == 64
    via_client = client.embeddings.create(model="tiny-embed", input="hello world")
    assert np.allclose(via_client.data[0].embedding, floats)


def test_pooling_route_answers_the_same_vectors(server, client):
    raw = httpx.post(f"{server[0].base_url}/pooling", json={"input": ["hello world", "hi"]})
    out = raw.json()
    assert raw.status_code == 200 and out["object"] == "list"
    assert [(d["object"], d["index"]) for d in out["data"]] == [("pooling", 0), ("pooling", 1)]
    floats = client.embeddings.create(model="tiny-embed", input="hello world",
                                      encoding_format="float").data[0].embedding
    assert np.allclose(out["data"][0]["data"], floats, atol=1e-6)
    assert out["usage"]["prompt_tokens"] == len(_ids("hello world")) + len(_ids("hi"))
    bad = httpx.post(f"{server[0].base_url}/pooling", json={"input": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_bench_embeddings_mode(server):
    import asyncio

    from sluice.bench.chat import BenchConfig
    from sluice.bench.embeddings import bench_embeddings

    config = BenchConfig(base_url=f"{server[0].base_url}/v1", model=None, concurrency=2,
                         num_requests=4, max_tokens=1, temperature=0.0, ignore_eos=False,
                         api_key=None, fresh_connections=False, warmup=0,
                         prompts=["hello world", "hi there", "user"])
    result = asyncio.run(bench_embeddings(config, batch_size=3))
    assert (result.completed, result.errors, result.embeddings) == (4, 0, 12)
    assert result.model == "tiny-embed" and result.embeddings_per_s > 0
    # Each request embeds the three prompts once: 3 + 3 + 2 tokens (BOS included).
    assert result.prompt_tokens == 4 * 8


def test_matryoshka_dimensions_cut_then_renormalize(server, client):
    out = client.embeddings.create(model="tiny-embed", input="hello world", dimensions=16)
    vector = np.array(out.data[0].embedding)
    assert vector.shape == (16,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert cosine(vector, reference_vector(server[1], _ids("hello world"), 16)) > 0.9999


def test_truncate_prompt_tokens_keeps_the_opening(server, client):
    long_ids = [9, 10, 11, 12] * 10  # 40 tokens: past the 24-token context
    out = client.embeddings.create(model="tiny-embed", input=[long_ids],
                                   extra_body={"truncate_prompt_tokens": 5}, user="u-1")
    assert out.usage.prompt_tokens == 5
    assert cosine(out.data[0].embedding, reference_vector(server[1], long_ids[:5])) > 0.9999
    full = client.embeddings.create(model="tiny-embed", input=[long_ids],
                                    extra_body={"truncate_prompt_tokens": -1})
    assert full.usage.prompt_tokens == MAX_MODEL_LEN  # a pooling prompt may fill the context


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": ["hello", ""]}, "input", "input[1] is empty"),
    ({"input": [[1, 2], []]}, "input", "input[1] is empty"),
    ({"input": ["hello", 3]}, "input", "a list of strings"),
    ({"input": [1, "a"]}, "input", "a list of strings"),
    ({"input": [True, False]}, "input", "token ids"),
    ({"input": [[1, 2.5]]}, "input", "token ids"),
    ({"input": {"text": "x"}}, None, None),
    ({"input": 5}, None, None),
    ({"input": [1, 500]}, "input", "[0, 128)"),
    ({"input": [-1]}, "input", "[0, 128)"),
    ({"input": ["hi"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
    ({"input": [[9] * (MAX_MODEL_LEN + 1)]}, "input", "maximum context length"),
    ({"input": " ".join(["hello"] * 40)}, "input", "truncate_prompt_tokens"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
    ({"input": "hi", "truncate_prompt_tokens": 99}, "truncate_prompt_tokens", "larger"),
    ({"input": "hi", "dimensions": 20}, "dimensions", "one of [16, 32, 64]"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "one of"),
    ({"input": "hi", "encoding_format": "int8"}, None, None),
    ({"input": "hi", "dimensions": "16"}, None, None),
    ({"input": "hi", "unknown_field": 1}, None, None),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ({}, None, None),
])
def test_bad_input_is_a_clear_4xx(server, body, param, words):
    r = httpx.post(f"{server[0].base_url}/v1/embeddings", json=body)
    error = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400), r.text
    if param is not None:
        assert error["param"] == param
    if words is not None:
        assert words in error["message"]


def test_a_generating_route_is_refused_by_the_pooling_engine(server, client):
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.completions.create(model="tiny-embed", prompt=[5, 6], max_tokens=2)
    # Still serving afterwards.
    assert client.embeddings.create(model="tiny-embed", input="hi").data


def test_generating_server_has_no_embeddings(base_url):
    for path, body in (("/v1/embeddings", {"input": "hi"}),
                       ("/v1/rerank", {"query": "q", "documents": ["d"]})):
        r = httpx.post(f"{base_url}{path}", json=body)
        assert r.status_code == 404 and "--runner pooling" in r.json()["error"]["message"]


def test_an_embedding_model_has_no_rerank(server):
    r = httpx.post(f"{server[0].base_url}/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 404 and "cross-encoder" in r.json()["error"]["message"]
