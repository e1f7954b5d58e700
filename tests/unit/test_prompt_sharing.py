"""n > 1: candidates of one request (same prompt, ids `<id>-0`, `<id>-1`, …) admitted in the
same step share the prompt's full pages, so the prompt is prefilled once, on the tiny random
Llama of engine_builders."""

import msgspec
import pytest
import torch

from tests.unit.engine_builders import assert_all_free, build_core, random_weights, request, run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights():
    return random_weights()


PROMPT = [(5 * i + 2) % 120 for i in range(37)]  # 9 full pages of 4, and one token more
SHARED = 36  # tokens in full pages
N = 4
MAX_TOKENS = 10


def _candidates(prompt=PROMPT, salts=None, **params):
    salts = salts or [None] * N
    return [
        msgspec.structs.replace(
            request(f"req-{i}", prompt, max_tokens=MAX_TOKENS, **params), cache_salt=salt
        )
        for i, salt in enumerate(salts)
    ]


@pytest.fixture(scope="module")
def alone(weights):
    """Greedy tokens and logits of the prompt on its own engine: nothing to share."""
    core, rec = build_core(weights)
    result = run(core, [request("solo", PROMPT, max_tokens=MAX_TOKENS)])["solo"]
    assert len(result.tokens) == MAX_TOKENS
    return result.tokens, torch.stack(rec.logits["solo"])


def test_n_candidates_prefill_the_prompt_once(weights, alone):
    core, rec = build_core(weights)
    steps = []
    step = core.step

    def counting_step():
        before = core.num_computed_tokens
        out = step()
        steps.append(core.num_computed_tokens - before)
        return out

    core.step = counting_step
    results = run(core, _candidates())
    # Step one: the whole prompt once, plus each sibling's one token past the shared pages
    # (it must be fed to get logits). Every later step is one decode per candidate.
    assert steps[0] == len(PROMPT) + (N - 1) * (len(PROMPT) - SHARED)
    assert core.allocator.prefix_hits == (N - 1) * SHARED
    assert core.num_computed_tokens == len(PROMPT) + (N - 1) + N * (MAX_TOKENS - 1)
    tokens, logits = alone
    for i in range(N):
        assert results[f"req-{i}"].tokens == tokens
        torch.testing.assert_close(torch.stack(rec.logits[f"req-{i}"]), logits, atol=1e-5, rtol=0)
    assert_all_free(core)


def test_sharing_with_chunked_prefill(weights, alone):
    # A budget below the prompt: the leader fills pages chunk by chunk; siblings admitted
    # while it does take what is filled so far and never duplicate more than a chunk.
    core, rec = build_core(weights, budget=16)
    results = run(core, _candidates())
    assert all(results[f"req-{i}"].tokens == alone[0] for i in range(N))
    assert core.allocator.prefix_hits > 0
    assert core.num_computed_tokens < N * len(PROMPT)
    for i in range(N):
        torch.testing.assert_close(
            torch.stack(rec.logits[f"req-{i}"]), alone[1], atol=1e-5, rtol=0
        )


def test_sharing_survives_preemption(weights, alone):
    # 16 pages of 4: the shared prompt (10 pages) plus four growing tails does not fit.
    core, rec = build_core(weights, num_pages=16)
    results = run(core, _candidates())
    assert rec.preemptions > 0
    assert all(results[f"req-{i}"].tokens == alone[0] for i in range(N))
    assert all(r.finish_reason == "length" for r in results.values())


def test_seeded_candidates_differ_but_share_the_prompt(weights):
    core, _ = build_core(weights)
    reqs = [
        msgspec.structs.replace(r, params=msgspec.structs.replace(r.params, seed=i))
        for i, r in enumerate(_candidates(temperature=1.0))
    ]
    results = run(core, reqs)
    assert core.allocator.prefix_hits == (N - 1) * SHARED
    assert len({tuple(r.tokens) for r in results.values()}) > 1  # sampling still per seed
    alone_core, _ = build_core(weights)
    again = run(alone_core, [reqs[2]])["req-2"]
    assert again.tokens == results["req-2"].tokens  # same seed, same answer, shared or not


def test_different_salts_in_one_step_never_share(weights, alone):
    core, _ = build_core(weights)
    results = run(core, _candidates(salts=["a", "b", "a", "b"]))
    assert core.allocator.prefix_hits == 2 * SHARED  # one sibling per salt
    assert all(r.tokens == alone[0] for r in results.values())
