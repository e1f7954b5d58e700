"""vLLM's allowed_token_ids and bad_words in the engine (issue 17 item 17): real steps of a
tiny random Llama, greedy, so every token is the argmax of what the masks left."""

import pytest

from tests.unit.engine_builders import VOCAB, build_core, random_weights, request, run

PROMPT = [5, 9, 17, 3]


@pytest.fixture(scope="module")
def weights():
    return random_weights()


def _tokens(weights, **params) -> list[int]:
    core, _ = build_core(weights)
    return run(core, [request("r", PROMPT, max_tokens=12, **params)])["r"].tokens


def test_allowed_token_ids_keep_only_those(weights):
    free = _tokens(weights)
    allowed = [t for t in range(VOCAB) if t not in set(free)][:3]
    tokens = _tokens(weights, allowed_token_ids=allowed)
    assert tokens and set(tokens) <= set(allowed)
    assert _tokens(weights, allowed_token_ids=[free[0]]) == [free[0]] * 12


def test_a_single_token_bad_word_never_appears(weights):
    free = _tokens(weights)
    tokens = _tokens(weights, bad_words=[[free[0]]])
    assert free[0] not in tokens and len(tokens) == 12


def test_a_bad_word_bans_its_last_token_only_after_the_rest(weights):
    free = _tokens(weights)
    first, second = free[0], free[1]
    tokens = _tokens(weights, bad_words=[[first, second]])
    assert tokens[0] == first  # the word's start is fine on its own
    assert tokens[1] != second  # but it cannot be completed
    assert all(tokens[i:i + 2] != [first, second] for i in range(len(tokens) - 1))
    # A sequence whose start never comes changes nothing.
    absent = next(t for t in range(VOCAB) if t not in free)
    assert _tokens(weights, bad_words=[[absent, second]]) == free


def test_masks_are_per_row_in_a_batch(weights):
    core, _ = build_core(weights)
    free = _tokens(weights)
    results = run(core, [request("masked", PROMPT, max_tokens=12, bad_words=[[free[0]]]),
                         request("free", PROMPT, max_tokens=12)])
    assert results["free"].tokens == free and free[0] not in results["masked"].tokens


@pytest.mark.parametrize("params, field", [
    ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": list(range(VOCAB)) + [0]}, "allowed_token_ids"),
    ({"bad_words": [[]]}, "bad_words"),
    ({"bad_words": [[VOCAB]]}, "bad_words"),
    ({"bad_words": [[1] * 65]}, "bad_words"),
    ({"bad_words": [[1]] * 257}, "bad_words"),
])
def test_the_engine_refuses_out_of_range_masks(weights, params, field):
    """The engine trusts no frontend: a bad mask is a 400 for that request, not a step."""
    core, _ = build_core(weights)
    result = run(core, [request("bad", PROMPT, **params)])["bad"]
    assert result.finish_reason == "error" and result.error_status == 400
    assert field in result.error


def _budget(budget: int, inside: bool = True, start=(50,), end=(51, 52)):
    from shared.protocol import ThinkingBudget

    return ThinkingBudget(budget=budget, start_ids=list(start), end_ids=list(end),
                          starts_inside=inside)


def test_a_thinking_budget_writes_the_end_tag_when_spent(weights):
    """vLLM's thinking_token_budget: inside a thinking section the row thinks `budget`
    tokens, then the end tag comes, one token a step."""
    free = _tokens(weights)
    tokens = _tokens(weights, thinking=_budget(3))
    assert tokens[:3] == free[:3] and tokens[3:5] == [51, 52]
    assert _tokens(weights, thinking=_budget(0))[:2] == [51, 52]
    # Outside thinking (the prompt did not open it) nothing is forced until a start tag.
    outside = _tokens(weights, thinking=_budget(0, inside=False, start=(120, 121)))
    if 120 not in free:
        assert outside == free


def test_the_tracker_follows_sections_and_partial_tags():
    from engine.request.thinking import ThinkingTracker

    tracker = ThinkingTracker(_budget(2, inside=False, start=(7,), end=(8, 9)))
    prompt = [1, 2]
    tokens = prompt + [3, 7, 4]  # opens a section, thinks one token
    tracker.observe(tokens, len(prompt))
    assert tracker.inside and tracker.forced() is None
    tokens += [5]  # two thinking tokens: the budget is spent
    tracker.observe(tokens, len(prompt))
    assert tracker.forced() == 8
    tokens += [8]  # half the end tag is written: the next token completes it
    tracker.observe(tokens, len(prompt))
    assert tracker.forced() == 9
    tokens += [9]
    tracker.observe(tokens, len(prompt))
    assert not tracker.inside and tracker.forced() is None
    tokens += [7]  # a second section: the budget is already spent
    tracker.observe(tokens, len(prompt))
    assert tracker.forced() == 8


@pytest.mark.parametrize("spec", [
    {"budget": -1, "start_ids": [1], "end_ids": [2]},
    {"budget": 1, "start_ids": [], "end_ids": [2]},
    {"budget": 1, "start_ids": [1], "end_ids": [VOCAB]},
    {"budget": 1, "start_ids": [1], "end_ids": [2] * 17},
])
def test_the_engine_refuses_bad_thinking_budgets(weights, spec):
    from shared.protocol import ThinkingBudget

    core, _ = build_core(weights)
    result = run(core, [request("bad", PROMPT, thinking=ThinkingBudget(**spec))])["bad"]
    assert result.error_status == 400 and "thinking" in result.error
