"""Token selection: greedy, temperature, top-k, top-p and per-request seeds."""

import pytest
import torch

from engine.step.sampler import SamplingRows, sample
from shared.protocol import SamplingParams

VOCAB = 32


pytestmark = pytest.mark.usefixtures("one_thread")


def P(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=1, **kw)


def rows_for(params, generators=None, vocab=VOCAB) -> SamplingRows:
    generators = generators if generators is not None else [None] * len(params)
    return SamplingRows.build(params, generators, vocab)


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_build_maps_disabled_top_k_to_vocab():
    rows = rows_for([P(top_k=0), P(top_k=5, temperature=0.0)])
    assert rows.top_k.tolist() == [VOCAB, 5]
    assert rows.temperature.tolist() == [1.0, 0.0]
    assert not rows.all_greedy
    assert rows_for([P(temperature=0.0)] * 3).all_greedy


def test_greedy_is_argmax():
    logits = random_logits(16)
    out = sample(logits.clone(), rows_for([P(temperature=0.0)] * 16))
    assert out.tolist() == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_tokens_like_argmax():
    """bf16 logits tie often (values 1/8 apart near 20); a tie must go to the lower id, as
    argmax does, also over the model's vocabulary and with -inf (masked) entries."""
    logits = torch.full((3, 49152), float("-inf"))
    logits[0, [7, 300, 49000]] = 20.0
    logits[1] = torch.randn(49152).round()  # many exact ties at the maximum
    out = sample(logits.clone(), rows_for([P(temperature=0.0)] * 3, vocab=49152))
    assert out.tolist() == logits.argmax(-1).tolist()
    assert out[0] == 7 and out[2] == 0


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = random_logits(8)
    params = [P(temperature=0.0) if i % 2 == 0 else P(temperature=5.0) for i in range(8)]
    out = sample(logits.clone(), rows_for(params))
    assert out[::2].tolist() == logits.argmax(-1)[::2].tolist()


def test_high_temperature_is_not_greedy():
    # Guards the tests below: without top-k/top-p, temperature sampling does vary.
    torch.manual_seed(0)
    logits = random_logits(64, seed=1) / 3  # fairly flat rows
    out = sample(logits.clone(), rows_for([P(temperature=2.0)] * 64))
    assert (out != logits.argmax(-1)).sum() > 10


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0, 50.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    torch.manual_seed(0)
    logits = random_logits(64, seed=2)
    for _ in range(5):
        out = sample(logits.clone(), rows_for([P(temperature=temperature, top_k=1)] * 64))
        assert out.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 10.0])
def test_tiny_top_p_is_greedy(temperature):
    torch.manual_seed(0)
    logits = random_logits(64, seed=3)
    for _ in range(5):
        out = sample(logits.clone(), rows_for([P(temperature=temperature, top_p=1e-6)] * 64))
        assert out.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("k", [2, 3, 7])
def test_top_k_never_leaves_the_k_largest(k):
    torch.manual_seed(0)
    batch = 256
    logits = random_logits(batch, seed=4) / 3
    allowed = logits.topk(k, dim=-1).indices
    seen = torch.zeros(batch, VOCAB, dtype=torch.bool)
    for _ in range(20):
        out = sample(logits.clone(), rows_for([P(temperature=5.0, top_k=k)] * batch))
        assert (allowed == out.unsqueeze(1)).any(dim=1).all()
        seen[torch.arange(batch), out] = True
    # A hot temperature actually reaches beyond the top token within the k.
    assert (seen.sum(dim=1) > 1).float().mean() > 0.9


def test_top_p_never_leaves_the_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7, 0.8 >= 0.7).
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(2000, 4).clone()
    torch.manual_seed(0)
    out = sample(logits.clone(), rows_for([P(top_p=0.7)] * 2000, vocab=4))
    counts = torch.bincount(out, minlength=4).float() / 2000
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[1] - 0.5 / 0.8) < 0.04
    assert abs(counts[3] - 0.3 / 0.8) < 0.04


def _empirical(logits_row: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    vocab = logits_row.shape[0]
    logits = logits_row.expand(draws, vocab).clone()
    out = sample(logits, rows_for([params] * draws, vocab=vocab))
    return torch.bincount(out, minlength=vocab).float() / draws


LOGITS_8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampling_distribution_matches_softmax(temperature):
    torch.manual_seed(1234)
    freq = _empirical(LOGITS_8, P(temperature=temperature), draws=8000)
    expected = (LOGITS_8 / temperature).softmax(-1)
    # Standard error is at most sqrt(0.25 / 8000) ~ 0.0056; allow ~4 sigma.
    assert (freq - expected).abs().max() < 0.022, (freq, expected)


def test_top_k_distribution_is_renormalised_softmax():
    torch.manual_seed(99)
    freq = _empirical(LOGITS_8, P(top_k=3), draws=8000)
    expected = torch.zeros(8)
    keep = LOGITS_8.topk(3).indices
    expected[keep] = LOGITS_8[keep].softmax(-1)
    assert (freq - expected).abs().max() < 0.022, (freq, expected)


def test_top_p_distribution_is_renormalised_nucleus():
    torch.manual_seed(7)
    probs = LOGITS_8.softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    # Smallest prefix whose mass reaches 0.8.
    n = int((sorted_probs.cumsum(0) < 0.8).sum()) + 1
    expected = torch.zeros(8)
    expected[order[:n]] = sorted_probs[:n] / sorted_probs[:n].sum()
    assert 2 < n < 8
    freq = _empirical(LOGITS_8, P(top_p=0.8), draws=8000)
    assert (freq - expected).abs().max() < 0.022, (freq, expected)


# --- seeds -------------------------------------------------------------------------------------

SEEDED = P(seed=1234)


def _seeded_run(target: SamplingParams, companions: list[SamplingParams], position: int, steps=12):
    """Tokens drawn for `target` (seed 1234) over several steps in a batch with companions."""
    logits_target = random_logits(1, seed=5)[0] / 3
    generator = torch.Generator().manual_seed(target.seed)
    params = list(companions)
    params.insert(position, target)
    companion_gens = [
        torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in companions
    ]
    gens = list(companion_gens)
    gens.insert(position, generator)
    others = random_logits(len(companions), seed=6)
    tokens = []
    for _ in range(steps):
        logits = torch.cat([others[:position], logits_target[None], others[position:]])
        tokens.append(int(sample(logits, rows_for(params, gens))[position]))
    return tokens


COMPANIONS = {
    "unseeded": [P(), P(temperature=0.7)],
    "greedy": [P(temperature=0.0), P(temperature=0.0)],
    "other-seeds": [P(seed=1), P(seed=2, temperature=3.0)],
    "many": [P(seed=i) for i in range(9)],
}
# Companions whose top-k/top-p sends the whole batch down the sorted path.
FILTERING_COMPANIONS = {
    "top-k": [P(top_k=5)],
    "top-p": [P(top_p=0.5), P()],
}


def _check_seeded_independent_of_batch(target: SamplingParams, companions) -> None:
    torch.manual_seed(0)
    alone = _seeded_run(target, [], 0)
    assert len(set(alone)) > 3  # genuinely random, so agreement below means something
    assert _seeded_run(target, [], 0) == alone
    for position in (0, len(companions)):
        torch.manual_seed(position + 17)  # unseeded companions draw differently each time
        assert _seeded_run(target, companions, position) == alone


@pytest.mark.parametrize("name", sorted(COMPANIONS))
def test_seeded_row_independent_of_batch(name):
    _check_seeded_independent_of_batch(SEEDED, COMPANIONS[name])


@pytest.mark.parametrize("name", sorted(COMPANIONS) + sorted(FILTERING_COMPANIONS))
def test_seeded_filtered_row_independent_of_batch(name):
    # A row with its own top-k takes the sorted path whatever its companions do.
    companions = {**COMPANIONS, **FILTERING_COMPANIONS}[name]
    _check_seeded_independent_of_batch(P(seed=1234, top_k=12), companions)


@pytest.mark.parametrize("name", sorted(FILTERING_COMPANIONS))
def test_seeded_unfiltered_row_independent_of_filtering_companions(name):
    _check_seeded_independent_of_batch(SEEDED, FILTERING_COMPANIONS[name])


def test_different_seeds_differ():
    torch.manual_seed(0)
    a = _seeded_run(P(seed=1), [], 0)
    b = _seeded_run(P(seed=2), [], 0)
    assert a != b
