"""BeamSearch's bookkeeping on hand-made steps (the HTTP test compares it with transformers):
ranking over all beams, stops, min_tokens, max_tokens, scores and the three early_stopping
modes."""

import pytest

from frontend.pipeline.beam_search import BeamSearch, BeamSettings
from shared.protocol import LogprobEntry, TopLogprob

EOS = 0


def step(*pairs: tuple[int, float]) -> LogprobEntry:
    top = [TopLogprob(t, f"<{t}>", lp) for t, lp in pairs]
    return LogprobEntry(top[0].token_id, top[0].token, top[0].logprob, top)


def settings(**kw) -> BeamSettings:
    return BeamSettings(**{"width": 2, "max_tokens": 5, "stop_ids": frozenset({EOS}), **kw})


def test_keep_and_num_top():
    s = settings(width=3, stop_ids=frozenset({0, 1}))
    assert s.keep == 9 and s.num_top == 9
    assert settings(min_tokens=2).num_top == 5  # + the one stop id dropped early


def test_ranks_over_all_beams_and_finishes_only_the_top_width():
    search = BeamSearch(settings())
    search.advance([step((5, -0.1), (6, -0.2), (EOS, -3.0), (7, -4.0))])
    assert [b.tokens for b in search.running] == [[5], [6]]
    assert search.finished == []  # EOS ranked third of four: past the width, not kept
    search.advance([step((EOS, -0.1), (8, -1.0), (9, -2.0), (10, -3.0)),
                    step((11, -0.05), (EOS, -0.3), (12, -5.0), (13, -6.0))])
    # -0.2 (5,EOS), -0.25 (6,11) ... the first is a finish, the second keeps running
    assert [b.tokens for b in search.finished] == [[5, EOS]]
    assert search.finished[0].score == pytest.approx(-0.2 / 2)
    assert search.finished[0].stopped
    assert [b.tokens for b in search.running] == [[6, 11], [5, 8]]


def test_min_tokens_keeps_stop_ids_out():
    search = BeamSearch(settings(min_tokens=1))
    search.advance([step((EOS, -0.01), (5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4))])
    assert search.finished == [] and [b.tokens for b in search.running] == [[5], [6]]


def test_max_tokens_finishes_the_best_width_unstopped():
    search = BeamSearch(settings(max_tokens=1, length_penalty=2.0))
    search.advance([step((5, -1.0), (6, -2.0), (7, -3.0), (8, -4.0))])
    assert search.done
    assert [(b.tokens, b.score, b.stopped) for b in search.best(2)] == [
        ([5], -1.0, False), ([6], -2.0, False)]


@pytest.mark.parametrize(("early", "done"), [(True, True), (False, True), ("never", False)])
def test_early_stopping_modes(early, done):
    """Two beams finish at step 2 with scores -0.5 and -0.6; the best running beam sums
    -1.5 over 2 tokens. true: done (width finished). false: -1.5/2 = -0.75 cannot beat -0.6,
    done. "never" (length_penalty 1 > 0): scored at max_tokens 5, -1.5/5 = -0.3 might, so on."""
    search = BeamSearch(settings(early_stopping=early))
    search.advance([step((5, -0.4), (6, -0.5), (7, -5.0), (8, -6.0))])
    search.advance([step((EOS, -0.6), (9, -1.1), (10, -7.0), (11, -8.0)),
                    step((EOS, -0.7), (12, -1.3), (13, -7.0), (14, -8.0))])
    assert [b.score for b in search.finished] == pytest.approx([-0.5, -0.6])
    assert search.done is done


def test_false_goes_on_while_a_running_beam_can_still_win():
    search = BeamSearch(settings(early_stopping=False))
    search.advance([step((EOS, -0.4), (6, -0.45), (5, -0.5), (8, -6.0))])
    search.advance([step((EOS, -2.0), (9, -0.1), (10, -7.0), (11, -8.0)),
                    step((EOS, -3.0), (12, -0.2), (13, -7.0), (14, -8.0))])
    # finished: (EOS) -0.4 and nothing else of the top 2; not full, so on
    assert len(search.finished) == 1 and not search.done


def test_a_stop_string_ends_a_beam_as_a_stop_id_does():
    """`take` with text_stops: the candidate whose text reached a stop string finishes
    (within the width) and names it; one past the width is dropped, not kept running."""
    search = BeamSearch(settings())
    grown = search.candidates([step((5, -0.1), (6, -0.2), (7, -0.3), (8, -0.4))])
    search.take(grown, [None, "\n", "\n", None])
    assert [(b.tokens, b.stop_string, b.stopped) for b in search.finished] == [
        ([6], "\n", False)]
    assert [b.tokens for b in search.running] == [[5], [8]]
