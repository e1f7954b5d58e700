"""A step exception that belongs to one request fails that request, not the step (issue 15,
item 4): the fault is injected with a narrow mock, since valid input cannot cause it."""

import pytest

import engine.step.logits_processors as logits_processors
import engine.step.model_runner as model_runner
import engine.step.sampler as sampler
from tests.unit.engine_builders import (
    assert_all_free,
    build_core,
    prompts,
    random_weights,
    request,
    run,
)

BAD = "bad"


@pytest.fixture(scope="module")
def weights():
    return random_weights()


pytestmark = pytest.mark.usefixtures("one_thread")


def _requests(**bad_params):
    good = [request(f"good{i}", p, max_tokens=8) for i, p in enumerate(prompts([5, 9, 3]))]
    bad = request(BAD, [7, 8, 9], max_tokens=8, **bad_params)
    return [good[0], bad, *good[1:]]


@pytest.fixture(scope="module")
def expected(weights):
    core, _ = build_core(weights)
    return {k: r.tokens for k, r in run(core, _requests()).items() if k != BAD}


def _assert_only_bad_failed(core, results, expected, what: str) -> None:
    bad = results[BAD]
    assert (bad.finish_reason, bad.error_status) == ("error", 500)
    assert what in bad.error and "injected" in bad.error, bad.error
    for request_id, tokens in expected.items():
        assert results[request_id].finish_reason == "length"
        assert results[request_id].tokens == tokens, request_id
    assert_all_free(core)
    assert core.num_failed == 1


def test_logits_processor_fault_fails_one_request(weights, expected, monkeypatch):
    real = model_runner.process_logits

    def process_logits(logits, seqs):
        if any(s.request_id == BAD for s in seqs) and seqs[0].num_output_tokens >= 2:
            raise RuntimeError("injected processor fault")
        real(logits, seqs)

    monkeypatch.setattr(model_runner, "process_logits", process_logits)
    core, _ = build_core(weights)
    results = run(core, _requests())
    _assert_only_bad_failed(core, results, expected, "logits processors")
    assert len(results[BAD].tokens) == 2  # what it had before the fault stays delivered


def test_fault_after_in_place_changes_leaves_others_logits_intact(weights, expected,
                                                                 monkeypatch):
    # The batch's penalties ran on every row, then the bad row broke: the row-by-row retry
    # must start from fresh logits, or the good rows would be penalized twice.
    good = [request(f"good{i}", p, max_tokens=8, repetition_penalty=1.5)
            for i, p in enumerate(prompts([5, 9, 3]))]
    reference, _ = build_core(weights)
    want = {k: r.tokens for k, r in run(reference, good).items()}
    real = logits_processors._penalties

    def penalties(logits, seqs):
        real(logits, seqs)
        if any(s.request_id == BAD for s in seqs):
            raise ValueError("injected after the penalties")

    monkeypatch.setattr(logits_processors, "_penalties", penalties)
    core, _ = build_core(weights)
    results = run(core, [*good, request(BAD, [7, 8, 9], max_tokens=8)])
    _assert_only_bad_failed(core, results, want, "logits processors")


def test_sampling_fault_keeps_seeded_neighbours_reproducible(weights, monkeypatch):
    seeded = [request(f"s{i}", p, max_tokens=8, temperature=1.0, seed=i)
              for i, p in enumerate(prompts([4, 6]))]
    core, _ = build_core(weights)
    want = {k: r.tokens for k, r in run(core, seeded).items()}
    real = model_runner.token_logprobs

    def token_logprobs(logits, chosen, num_top):
        if num_top == 3:  # only the bad request asks for 3; the batch drew noise already
            raise IndexError("injected logprobs fault")
        return real(logits, chosen, num_top)

    monkeypatch.setattr(model_runner, "token_logprobs", token_logprobs)
    core, _ = build_core(weights)
    bad = request(BAD, [7, 8, 9], max_tokens=8, temperature=1.0, logprobs=3)
    results = run(core, [seeded[0], bad, seeded[1]])
    _assert_only_bad_failed(core, results, want, "logprobs")
    assert results[BAD].tokens == []


def test_sampler_fault_names_sampling(weights, expected, monkeypatch):
    real = sampler.SamplingRows.build

    def build(params, generators, vocab):
        if any(p.top_p == 0.5 for p in params):
            raise OverflowError("injected sampler fault")
        return real(params, generators, vocab)

    monkeypatch.setattr(model_runner.SamplingRows, "build", staticmethod(build))
    core, _ = build_core(weights)
    results = run(core, _requests(top_p=0.5, temperature=1.0))
    _assert_only_bad_failed(core, results, expected, "sampling")


def test_forward_fault_still_propagates(weights, monkeypatch):
    core, _ = build_core(weights)
    core.add(request("r", [1, 2, 3]))

    def forward(*args):
        raise RuntimeError("the forward pass broke")

    monkeypatch.setattr(core.runner.model, "forward", forward)
    with pytest.raises(RuntimeError, match="forward pass"):
        core.step()
