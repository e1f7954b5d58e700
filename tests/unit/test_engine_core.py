"""EngineCore end to end on a tiny random Llama: batching invariance, transformers parity,
abort, stop conditions and request validation. No sockets, no real checkpoint."""


import msgspec
import pytest
import torch

from shared.protocol import unpack_ids
from tests.unit.engine_builders import (
    CONFIG,
    VOCAB,
    Recorder,
    Result,
    assert_all_free,
    build_core,
    collect,
    drain,
    hf_config_kwargs,
    prompts,
    random_weights,
    request,
    run,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights()


PROMPT_LENGTHS = [5, 17, 1, 40, 9, 23]


# --- batching invariance ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alone(weights):
    """Greedy tokens (and logits) of each prompt run on its own in a roomy engine."""
    tokens, logits = {}, {}
    for i, prompt in enumerate(prompts(PROMPT_LENGTHS)):
        core, rec = build_core(weights)
        result = run(core, [request(f"p{i}", prompt)])[f"p{i}"]
        assert result.finish_reason == "length" and len(result.tokens) == 12
        tokens[f"p{i}"] = result.tokens
        logits[f"p{i}"] = torch.stack(rec.logits[f"p{i}"])
    return tokens, logits


def test_reference_argmax_margins_are_clear(alone):
    # Batching changes float rounding (~1e-6, checked below); the invariance tests rely on
    # greedy choices that such noise cannot flip.
    _, logits = alone
    for rows in logits.values():
        top2 = rows.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4
    # A random model that emitted one token forever would make the comparisons toothless.
    tokens, _ = alone
    assert len({t for seq in tokens.values() for t in seq}) > 10


def _all_requests():
    return [request(f"p{i}", p) for i, p in enumerate(prompts(PROMPT_LENGTHS))]


def _assert_logits_match(rec: Recorder, alone) -> None:
    for request_id, rows in alone[1].items():
        torch.testing.assert_close(torch.stack(rec.logits[request_id]), rows, atol=1e-5, rtol=0)


def test_batched_equals_alone(weights, alone):
    core, rec = build_core(weights)
    results = run(core, _all_requests())
    assert {k: r.tokens for k, r in results.items()} == alone[0]
    _assert_logits_match(rec, alone)
    assert rec.max_batch == len(PROMPT_LENGTHS)
    assert core.stats().max_seqs_in_step == len(PROMPT_LENGTHS)


def test_chunked_prefill_equals_alone(weights, alone):
    core, rec = build_core(weights, budget=8)
    results = run(core, _all_requests())
    assert {k: r.tokens for k, r in results.items()} == alone[0]
    assert rec.chunked >= 4  # the 40-token prompt alone continues its prefill 4 times
    _assert_logits_match(rec, alone)
    assert all(r.finish_reason == "length" for r in results.values())


def test_staggered_arrivals_equal_alone(weights, alone):
    core, rec = build_core(weights, budget=16)
    results = run(core, _all_requests(), arrivals=[0, 0, 3, 5, 6, 11])
    assert {k: r.tokens for k, r in results.items()} == alone[0]
    _assert_logits_match(rec, alone)
    assert rec.max_batch > 1


@pytest.mark.parametrize("budget", [512, 7])
def test_preemption_equals_alone(weights, alone, budget):
    # 16 pages of 4 tokens: the longest request (40 + 12) fits alone, the batch never does.
    core, rec = build_core(weights, num_pages=16, budget=budget)
    results = run(core, _all_requests())
    assert {k: r.tokens for k, r in results.items()} == alone[0]
    assert rec.preemptions > 0
    assert all(r.finish_reason == "length" for r in results.values())
    # Recompute feeds the pending token back in and draws the next one: no row is repeated.
    _assert_logits_match(rec, alone)


def test_max_num_seqs_one_equals_alone(weights, alone):
    core, rec = build_core(weights, max_num_seqs=1)
    results = run(core, _all_requests())
    assert {k: r.tokens for k, r in results.items()} == alone[0]
    assert rec.max_batch == 1


def test_streamed_outputs_one_token_per_step(weights):
    core, _ = build_core(weights)
    core.add(request("a", prompts([6])[0], max_tokens=5))
    outputs = []
    while core.has_work:
        outputs.extend(out for _, out in core.step())
    assert [len(unpack_ids(o.new_token_ids)) for o in outputs] == [1] * 5
    assert [o.num_output_tokens for o in outputs] == [1, 2, 3, 4, 5]
    assert [o.finish_reason for o in outputs] == [None] * 4 + ["length"]
    assert outputs[0].first_token_time is not None
    assert all(o.first_token_time is None for o in outputs[1:])
    assert all(o.num_prompt_tokens == 6 for o in outputs)
    stats = core.stats()
    assert stats.num_finished == 1 and stats.num_free_pages == stats.num_total_pages


# --- parity with transformers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(weights):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(**hf_config_kwargs(
        head_dim=CONFIG.head_dim,
        rms_norm_eps=CONFIG.rms_norm_eps,
        rope_theta=CONFIG.rope_theta,
        max_position_embeddings=CONFIG.max_position_embeddings,
        tie_word_embeddings=False,
    ))
    model = transformers.LlamaForCausalLM(hf_config).to(torch.float32).eval()
    model.load_state_dict(weights, strict=True)
    return model


def _hf_greedy(model, prompt: list[int], steps: int):
    ids = list(prompt)
    logits = []
    with torch.no_grad():
        for _ in range(steps):
            last = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(last)
            ids.append(int(last.argmax()))
    return ids[len(prompt) :], torch.stack(logits)


@pytest.mark.parametrize("budget", [512, 8], ids=["whole-prefill", "chunked"])
def test_matches_transformers(weights, hf_model, budget):
    steps = 20
    lengths = [13, 3, 29]
    ps = prompts(lengths, seed=7)
    core, rec = build_core(weights, budget=budget, page_size=4)
    results = run(core, [request(f"q{i}", p, max_tokens=steps) for i, p in enumerate(ps)])
    for i, prompt in enumerate(ps):
        hf_tokens, hf_logits = _hf_greedy(hf_model, prompt, steps)
        ours = torch.stack(rec.logits[f"q{i}"])
        assert ours.shape == hf_logits.shape == (steps, VOCAB)
        torch.testing.assert_close(ours, hf_logits, atol=1e-4, rtol=0)
        assert results[f"q{i}"].tokens == hf_tokens
    # The logits are not trivially equal (e.g. all zero).
    assert hf_logits.std() > 0.5


# --- abort ------------------------------------------------------------------------------------


def test_abort_frees_pages_and_reports_abort(weights):
    core, _ = build_core(weights, max_num_seqs=2, budget=64)
    ps = prompts([10, 12, 8])
    for i, p in enumerate(ps):
        core.add(request(f"a{i}", p, max_tokens=50))
    results: dict[str, Result] = {}
    for _ in range(3):
        collect(results, core.step())
    assert set(results) == {"a0", "a1"}  # a2 waits: max_num_seqs=2
    assert core.allocator.num_free < core.allocator.num_pages
    streamed = len(results["a0"].tokens)
    assert streamed == 3

    core.abort(["a0", "a2", "never-heard-of"])
    assert "a0" not in core.sequences and "a2" not in core.sequences
    collect(results, core.step())
    assert results["a0"].finish_reason == "abort"
    assert results["a2"].finish_reason == "abort" and results["a2"].tokens == []
    assert "never-heard-of" not in results
    # a0's earlier tokens are not sent again; whatever ran since is (at most) reported once.
    assert len(results["a0"].tokens) == streamed

    core.abort(["a1"])
    collect(results, core.step())
    assert results["a1"].finish_reason == "abort"
    assert_all_free(core)
    assert not core.has_work
    stats = core.stats()
    assert stats.num_aborted == 3 and stats.num_finished == 0
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_abort_after_finish_is_a_no_op(weights):
    core, _ = build_core(weights)
    results = run(core, [request("f", prompts([4])[0], max_tokens=2)])
    core.abort(["f"])
    assert not core.has_work
    assert core.step() == []
    assert results["f"].finish_reason == "length"
    assert core.stats().num_aborted == 0


def test_abort_of_preempted_request(weights):
    core, rec = build_core(weights, num_pages=16)
    for i, p in enumerate(prompts(PROMPT_LENGTHS)):
        core.add(request(f"p{i}", p, max_tokens=20))
    results: dict[str, Result] = {}
    while not rec.preemptions:
        collect(results, core.step())
    waiting = [s.request_id for s in core.scheduler.waiting]
    assert waiting
    core.abort([s.request_id for s in core.scheduler.running] + waiting)
    drain(core, results)
    assert all(results[w].finish_reason == "abort" for w in waiting)
    assert_all_free(core)


# --- stop conditions ----------------------------------------------------------------------------

STOP_PROMPT = prompts([11], seed=3)[0]


@pytest.fixture(scope="module")
def free_run(weights) -> list[int]:
    """The greedy continuation of STOP_PROMPT with nothing to stop it."""
    core, _ = build_core(weights)
    tokens = run(core, [request("r", STOP_PROMPT, max_tokens=16)])["r"].tokens
    assert len(tokens) == 16
    return tokens


def _one(weights, eos=(), max_model_len=256, **params) -> Result:
    core, _ = build_core(weights, eos=eos, max_model_len=max_model_len)
    return run(core, [request("s", STOP_PROMPT, **params)])["s"]


def _first_stop(tokens, stops) -> int:
    return next(i for i, t in enumerate(tokens) if t in stops)


def test_stop_token_ids(weights, free_run):
    stop = free_run[3]
    k = free_run.index(stop)
    r = _one(weights, max_tokens=16, stop_token_ids=[stop])
    assert (r.finish_reason, r.stop_reason) == ("stop", stop)
    assert r.tokens == free_run[: k + 1]  # the stop token itself is reported


def test_eos(weights, free_run):
    eos = free_run[4]
    k = free_run.index(eos)
    unused = next(t for t in range(VOCAB) if t not in free_run)
    r = _one(weights, eos=(eos, unused), max_tokens=16)
    assert (r.finish_reason, r.stop_reason) == ("stop", None)
    assert r.tokens == free_run[: k + 1]


def test_ignore_eos(weights, free_run):
    r = _one(weights, eos=(free_run[0],), max_tokens=16, ignore_eos=True)
    assert (r.finish_reason, r.stop_reason) == ("length", None)
    assert r.tokens == free_run


def test_ignore_eos_still_honours_stop_token_ids(weights, free_run):
    eos, stop = free_run[1], free_run[5]
    r = _one(weights, eos=(eos,), max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    k = _first_stop(free_run, {stop})
    assert (r.finish_reason, r.stop_reason) == ("stop", stop)
    assert r.tokens == free_run[: k + 1]


@pytest.mark.parametrize("min_tokens", [1, 3, 6])
def test_min_tokens_gates_stop_tokens(weights, free_run, min_tokens):
    # Every token seen in the first min_tokens outputs is a stop token: without the gate the
    # request would end on its first output.
    stops = sorted(set(free_run[:min_tokens]))
    ungated = _one(weights, max_tokens=16, stop_token_ids=stops)
    assert ungated.finish_reason == "stop" and len(ungated.tokens) == 1
    r = _one(weights, max_tokens=16, stop_token_ids=stops, min_tokens=min_tokens)
    # Stop tokens are masked, not merely ignored, until min_tokens are out (as vLLM).
    assert not set(r.tokens[:min_tokens]) & set(stops)
    assert len(r.tokens) > min_tokens
    if r.finish_reason == "stop":
        assert r.stop_reason == r.tokens[-1] and r.tokens[-1] in stops
    else:
        assert r.finish_reason == "length" and len(r.tokens) == 16


@pytest.mark.parametrize("min_tokens", [1, 3])
def test_min_tokens_gates_eos(weights, free_run, min_tokens):
    eos = tuple(sorted(set(free_run[:min_tokens])))
    ungated = _one(weights, eos=eos, max_tokens=16)
    assert ungated.finish_reason == "stop" and len(ungated.tokens) == 1
    r = _one(weights, eos=eos, max_tokens=16, min_tokens=min_tokens)
    assert not set(r.tokens[:min_tokens]) & set(eos)
    assert len(r.tokens) > min_tokens
    if r.finish_reason == "stop":
        assert r.stop_reason is None and r.tokens[-1] in eos
    else:
        assert r.finish_reason == "length" and len(r.tokens) == 16


def test_min_tokens_does_not_delay_length(weights, free_run):
    # min_tokens above max_tokens is refused (shared.param_ranges, as vLLM); equal, the
    # request still ends at max_tokens.
    r = _one(weights, max_tokens=4, min_tokens=4)
    assert r.finish_reason == "length" and r.tokens == free_run[:4]


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens(weights, free_run, max_tokens):
    r = _one(weights, max_tokens=max_tokens)
    assert (r.finish_reason, r.stop_reason) == ("length", None)
    assert r.tokens == free_run[:max_tokens]


def test_max_model_len_caps_output(weights, free_run):
    room = 5
    r = _one(weights, max_model_len=len(STOP_PROMPT) + room, max_tokens=100)
    assert r.finish_reason == "length"
    assert r.tokens == free_run[:room]


def test_max_model_len_one_token_of_room(weights, free_run):
    r = _one(weights, max_model_len=len(STOP_PROMPT) + 1, max_tokens=100)
    assert r.finish_reason == "length" and r.tokens == free_run[:1]


def test_seeded_sampling_reproducible_across_batches(weights):
    params = dict(temperature=1.0, seed=42, max_tokens=10)
    p = prompts([9], seed=11)[0]
    core, _ = build_core(weights)
    solo = run(core, [request("x", p, **params)])["x"].tokens
    core, _ = build_core(weights, budget=5)
    others = [request(f"o{i}", q, temperature=1.0) for i, q in enumerate(prompts([3, 14, 7]))]
    mixed = run(core, [*others, request("x", p, **params)], arrivals=[0, 0, 2, 1])["x"].tokens
    assert mixed == solo
    core, _ = build_core(weights)
    other_seed = run(core, [request("x", p, **{**params, "seed": 43})])["x"].tokens
    assert other_seed != solo


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt,params,max_model_len",
    [
        ([], {}, 256),
        ([1, VOCAB, 2], {}, 256),
        ([1, 2**31 - 1], {}, 256),
        ([-1, 3], {}, 256),
        (list(range(32)), {}, 32),
        (list(range(40)), {}, 32),
        ([1, 2], {"max_tokens": 0}, 256),
        ([1, 2], {"seed": 2**64, "temperature": 1.0}, 256),
        ([1, 2], {"seed": -1, "temperature": 1.0}, 256),
        ([1, 2], {"logit_bias": [(VOCAB, 5.0)]}, 256),
        ([1, 2], {"logit_bias": [(-1, 5.0)]}, 256),
        ([1, 2], {"stop_token_ids": [VOCAB], "min_tokens": 2}, 256),
        ([1, 2], {"top_k": 2**63}, 256),
        ([1, 2], {"max_tokens": 2**64 - 1}, 256),
        ([1, 2], {"temperature": float("inf")}, 256),
        ([1, 2], {"temperature": float("nan")}, 256),
        ([1, 2], {"temperature": -1.0}, 256),
        ([1, 2], {"top_p": 1e-45, "temperature": 1.0}, 256),
        ([1, 2], {"repetition_penalty": 1e-45}, 256),
        ([1, 2], {"logit_bias": [(3, float("inf"))]}, 256),
        ([1, 2], {"logprobs": 2**63}, 256),
        ([1, 2], {"min_tokens": 2**63}, 256),
        ([1, 2], {"max_tokens": 4, "min_tokens": 10}, 256),
    ],
    ids=[
        "empty",
        "id-equals-vocab",
        "id-huge",
        "id-negative",
        "prompt-equals-max-len",
        "prompt-over-max-len",
        "max-tokens-zero",
        "seed-too-large",
        "seed-negative",
        "logit-bias-id-equals-vocab",
        "logit-bias-id-negative",
        "stop-token-id-equals-vocab",
        "top-k-2**63",
        "max-tokens-uint64",
        "temperature-inf",
        "temperature-nan",
        "temperature-negative",
        "top-p-denormal",
        "repetition-penalty-denormal",
        "logit-bias-inf",
        "logprobs-huge",
        "min-tokens-huge",
        "min-tokens-above-max-tokens",
    ],
)
def test_invalid_request_rejected(weights, prompt, params, max_model_len):
    core, _ = build_core(weights, max_model_len=max_model_len)
    core.add(request("bad", prompt, **params))
    core.add(request("good", [5, 6, 7], max_tokens=3))
    assert "bad" not in core.sequences
    results = drain(core)
    bad = results["bad"]
    assert (bad.finish_reason, bad.error_status) == ("error", 400)
    assert bad.error and bad.tokens == [] and bad.num_outputs == 1
    assert bad.num_prompt_tokens == len(prompt)
    assert results["good"].finish_reason == "length" and len(results["good"].tokens) == 3
    assert_all_free(core)
    assert core.stats().num_finished == 1


@pytest.mark.parametrize("field,value", [
    ("priority", 2**63), ("request_id", "r" * 2000), ("cache_salt", "s" * 5000),
    ("prompt_token_ids", b"\x01\x02\x03"),
])
def test_invalid_request_fields_rejected(weights, field, value):
    core, _ = build_core(weights)
    core.add(msgspec.structs.replace(request("bad", [1, 2]), **{field: value}))
    outputs = core.step()
    assert [(o.finish_reason, o.error_status) for _, o in outputs] == [("error", 400)]
    assert not core.has_work


def test_rejection_is_reported_without_running_anything(weights):
    core, _ = build_core(weights)
    core.add(request("bad", []))
    assert core.has_work
    outputs = core.step()
    assert [o.finish_reason for _, o in outputs] == ["error"]
    assert core.stats().num_steps == 0
    assert not core.has_work


def test_duplicate_request_id_rejected_without_disturbing_original(weights, free_run):
    core, _ = build_core(weights)
    core.add(request("dup", STOP_PROMPT, max_tokens=6))
    results: dict[str, Result] = {}
    collect(results, core.step())
    core.add(request("dup", [1, 2, 3], max_tokens=6))
    outputs = core.step()
    errors = [o for _, o in outputs if o.finish_reason == "error"]
    assert len(errors) == 1 and errors[0].error_status == 400
    assert errors[0].request_id == "dup" and errors[0].new_token_ids == b""
    # The original keeps its tokens and finishes normally.
    collect(results, [(r, o) for r, o in outputs if o.finish_reason != "error"])
    drain(core, results)
    assert results["dup"].tokens == free_run[:6]
    assert results["dup"].finish_reason == "length"
    assert_all_free(core)


def test_request_id_reusable_after_finish(weights, free_run):
    core, _ = build_core(weights)
    first = run(core, [request("r", STOP_PROMPT, max_tokens=3)])["r"]
    second = run(core, [request("r", STOP_PROMPT, max_tokens=3)])["r"]
    assert first.tokens == second.tokens == free_run[:3]
    assert second.finish_reason == "length"
