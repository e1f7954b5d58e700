"""The pooling runner in-process (vLLM's --runner pooling): a tiny Qwen3-shaped embedding
checkpoint (tests/tiny_embedder.py) served by build_engine's EngineCore, compared with
transformers in float32; prefill-only requests batched in one step, whole, with every page
back afterwards and nothing in the prefix cache; and what the engine refuses."""

import numpy as np
import pytest
import torch

from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.protocol import (
    EngineRequest,
    PoolingParams,
    SamplingParams,
    pack_ids,
    unpack_tensor,
)
from shared.runner_config import (
    PoolerConfig,
    parse_pooler_config,
    pooling_facts,
    resolve_runner,
)
from tests.tiny_embedder import MATRYOSHKA, build_embedder, cosine, reference_vector
from tests.unit.engine_builders import build_core, random_weights

MAX_MODEL_LEN = 48
REPLY = "inproc://pooling-test"
EMBED = PoolingParams()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = tmp_path_factory.mktemp("embedder")
    return str(path), build_embedder(str(path))


def _core(path: str, **extra):
    config = EngineConfig(model=path, served_model_name="e", request_address="inproc://e",
                          device="cpu", dtype="float32", page_size=4, num_pages=64,
                          max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16, **extra)
    return build_engine(config)


@pytest.fixture(scope="module")
def core(embedder):
    return _core(embedder[0])


def _request(rid: str, ids, pooling: PoolingParams | None = EMBED):
    return EngineRequest(rid, pack_ids(ids), SamplingParams(max_tokens=1), REPLY, 0.0,
                         pooling=pooling)


def _drain(core) -> dict:
    outs = {}
    for _ in range(100):
        for _, out in core.step():
            outs[out.request_id] = out
        if not core.has_work:
            return outs
    raise AssertionError("the engine did not finish")


PROMPTS = [[5, 9, 10], list(range(4, 13)) * 3, [7], [9, 10, 11, 12] * 5]


def test_runner_and_pooler_come_from_the_checkpoint(embedder):
    path = embedder[0]
    assert resolve_runner(path) == "pooling"  # architectures: ["Qwen3Model"]
    assert resolve_runner(path, "generate") == "generate"
    facts = pooling_facts(path)
    assert facts.pooler == PoolerConfig("LAST", True)
    assert facts.is_matryoshka and facts.matryoshka_dimensions == MATRYOSHKA
    assert pooling_facts(path, '{"pooling_type": "mean", "normalize": false}').pooler == \
        PoolerConfig("MEAN", False)
    for bad in ("[1]", "{", '{"pooling_type": "MAX"}', '{"normalize": 1}', '{"x": 1}'):
        with pytest.raises(ValueError):
            parse_pooler_config(bad)


def test_batched_mixed_lengths_match_transformers_and_free_every_page(embedder, core):
    model = embedder[1]
    free, hits = core.allocator.num_free, core.allocator.prefix_queries
    steps = core.num_steps
    for i, ids in enumerate(PROMPTS):
        core.add(_request(f"b{i}", ids))
    outs = _drain(core)
    for i, ids in enumerate(PROMPTS):
        out = outs[f"b{i}"]
        assert out.finish_reason == "stop" and out.error is None
        assert out.num_prompt_tokens == len(ids) and out.new_token_ids == b""
        vector = unpack_tensor(out.pooled)
        assert vector.shape == (64,) and vector.dtype == np.float32
        assert cosine(vector, reference_vector(model, ids)) > 0.9999
        assert abs(np.linalg.norm(vector) - 1) < 1e-5
    # Batched (the 27- and 20-token prompts each fill a step with the short ones), whole
    # (a prompt longer than the 16-token budget still ran as one chunk: the budget grows to
    # max_model_len), and no page kept or cached.
    assert core.max_seqs_in_step >= 2
    assert core.num_steps - steps < len(PROMPTS)
    assert core.allocator.num_free == free == core.allocator.num_pages
    assert core.allocator.prefix_queries == hits and not core.sequences


def test_same_prompt_twice_is_not_served_from_the_prefix_cache(core):
    ids = [9, 10, 11, 12] * 4
    core.add(_request("p1", ids))
    core.add(_request("p2", ids))
    outs = _drain(core)
    assert core.allocator.prefix_hits == 0
    assert np.array_equal(unpack_tensor(outs["p1"].pooled), unpack_tensor(outs["p2"].pooled))


def test_matryoshka_cut_then_normalize_and_normalize_off(embedder, core):
    model = embedder[1]
    ids = [5, 6, 7, 8, 9]
    core.add(_request("d16", ids, PoolingParams(dimensions=16)))
    core.add(_request("raw", ids, PoolingParams(normalize=False)))
    outs = _drain(core)
    short = unpack_tensor(outs["d16"].pooled)
    assert short.shape == (16,) and abs(np.linalg.norm(short) - 1) < 1e-5
    assert cosine(short, reference_vector(model, ids, 16)) > 0.9999
    raw = unpack_tensor(outs["raw"].pooled)
    expected = reference_vector(model, ids, normalize=False)
    assert torch.allclose(torch.from_numpy(raw), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("ids", "pooling", "why"), [
    ([5, 6], None, "does not generate"),
    ([5, 6], PoolingParams(dimensions=20), "dimensions must be one of"),
    ([5, 6], PoolingParams(dimensions=0), "dimensions must be one of"),
    ([5, 6], PoolingParams(task="classify"), "not served"),
    ([5] * (MAX_MODEL_LEN + 1), PoolingParams(), "more than max_model_len"),
    ([], PoolingParams(), "empty"),
])
def test_pooling_engine_refuses(core, ids, pooling, why):
    core.add(_request("bad", ids, pooling))
    out = _drain(core)["bad"]
    assert out.finish_reason == "error" and out.error_status == 400 and why in out.error
    assert core.allocator.num_free == core.allocator.num_pages


def test_a_prompt_of_max_model_len_is_pooled_whole(core):
    core.add(_request("full", [5] * MAX_MODEL_LEN))
    out = _drain(core)["full"]
    assert out.error is None and unpack_tensor(out.pooled).shape == (64,)


def test_dimensions_refused_without_matryoshka_and_generating_engine_refuses_pooling(
        embedder, tmp_path):
    core = _core(embedder[0], pooler_config='{"pooling_type": "MEAN"}', runner="pooling")
    facts = core.pooling
    assert facts.pooler.pooling_type == "MEAN"
    core.pooling = type(facts)(facts.pooler)  # the same model, not Matryoshka-trained
    core.add(_request("d", [5, 6], PoolingParams(dimensions=16)))
    core.add(_request("m", [5, 6, 7]))
    outs = _drain(core)
    assert "does not support matryoshka" in outs["d"].error
    assert cosine(unpack_tensor(outs["m"].pooled),
                  reference_vector(embedder[1], [5, 6, 7], pooling="MEAN")) > 0.9999

    generating, _ = build_core(random_weights())
    generating.add(_request("g", [5, 6]))
    out = _drain(generating)["g"]
    assert out.error_status == 400 and "--runner pooling" in out.error
