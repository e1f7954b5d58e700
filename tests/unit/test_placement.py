"""The placement policy (frontend/engine_client/placement.py, issue 18 item 3): prefix
affinity, the load bound, and that only the candidates given (the live engines) are ever chosen."""

from __future__ import annotations

import collections

import pytest

from frontend.engine_client.placement import (
    Candidate,
    Placement,
    load_bound,
    prefix_key,
    rank,
)
from shared.protocol import pack_ids


def _engines(*loads: int, kv: float = 0.0) -> list[Candidate]:
    return [Candidate(name=f"engine-{i}", load=load, kv_use=kv) for i, load in enumerate(loads)]


def test_the_key_covers_the_first_pages_and_the_salt():
    system = list(range(100, 164))  # four 16-token pages
    turn1 = pack_ids(system + [1, 2, 3])
    turn2 = pack_ids(system + [1, 2, 3, 9, 9, 9, 9])  # the same chat, one turn later
    assert prefix_key(turn1, None) == prefix_key(turn2, None)
    # A short first turn and the longer next one share their full pages, hence the key.
    first = pack_ids(list(range(40)))
    assert prefix_key(first, None) == prefix_key(pack_ids(list(range(40)) + [5] * 50), None)
    assert prefix_key(pack_ids([1, 2]), None) != prefix_key(pack_ids([1, 3]), None)
    assert prefix_key(turn1, "tenant-a") != prefix_key(turn1, None)
    assert prefix_key(turn1, "tenant-a") != prefix_key(turn1, "tenant-b")
    other = pack_ids([7] + system)
    assert prefix_key(other, None) != prefix_key(turn1, None)
    # A smaller page size covers fewer tokens: a difference past them does not count.
    assert prefix_key(pack_ids(system[:8] + [1]), None, page_size=2) == \
        prefix_key(pack_ids(system[:8] + [2]), None, page_size=2)


def test_rendezvous_order_is_stable_and_spreads_keys():
    names = [f"engine-{i}" for i in range(4)]
    first = collections.Counter()
    for i in range(400):
        key = prefix_key(pack_ids([i] * 64), None)
        order = rank(key, names)
        assert order == rank(key, list(reversed(names)))  # no dependence on list order
        first[order[0]] += 1
    assert set(first) == set(names)
    assert min(first.values()) > 50  # roughly a quarter each
    # Removing an engine moves only the keys it held.
    key = prefix_key(pack_ids([5] * 64), None)
    order = rank(key, names)
    assert rank(key, [n for n in names if n != order[-1]])[0] == order[0]


def test_identical_prefixes_land_on_one_engine_while_loads_are_even():
    placement = Placement("prefix")
    key = prefix_key(pack_ids(list(range(64))), "s")
    chosen = {placement.choose(key, _engines(3, 3, 3)) for _ in range(20)}
    assert len(chosen) == 1


def test_the_load_bound_spills_a_hot_key_to_its_second_choice():
    placement = Placement("prefix", load_factor=1.25)
    key = prefix_key(pack_ids(list(range(64))), None)
    names = [f"engine-{i}" for i in range(3)]
    preferred, second, _ = rank(key, names)
    candidates = [Candidate(name=n, load=10 if n == preferred else 2) for n in names]
    # Mean after placing is 15/3 = 5, bound ceil(6.25) = 7: the preferred engine (10) is out.
    assert load_bound(candidates, 1.25) == 7
    assert placement.choose(key, candidates) == second
    # Every frontend spills the same key to the same engine.
    assert Placement("prefix").choose(key, list(reversed(candidates))) == second


def test_a_nearly_full_kv_cache_with_a_queue_takes_no_affinity_traffic():
    key = prefix_key(pack_ids(list(range(64))), None)
    names = [f"engine-{i}" for i in range(2)]
    preferred, other = rank(key, names)
    candidates = [Candidate(name=preferred, load=1, kv_use=0.99, waiting=1),
                  Candidate(name=other, load=1, kv_use=0.2)]
    assert Placement("prefix").choose(key, candidates) == other


def test_the_bound_never_refuses_every_engine():
    placement = Placement("prefix")
    key = prefix_key(pack_ids([1] * 64), None)
    candidates = [Candidate(name="a", load=50, kv_use=0.99, waiting=5),
                  Candidate(name="b", load=40, kv_use=0.99, waiting=5)]
    assert placement.choose(key, candidates) == "b"  # all full: the least loaded


def test_least_loaded_and_round_robin():
    assert Placement("least-loaded").choose(b"k", _engines(4, 1, 3)) == "engine-1"
    ties = [Candidate("a", 2, kv_use=0.5), Candidate("b", 2, kv_use=0.1)]
    assert Placement("least-loaded").choose(b"k", ties) == "b"
    rr = Placement("round-robin")
    picks = [rr.choose(b"same", _engines(0, 0, 0)) for _ in range(6)]
    assert picks == ["engine-0", "engine-1", "engine-2"] * 2


@pytest.mark.parametrize("policy", ["prefix", "least-loaded", "round-robin"])
def test_only_live_candidates_are_chosen(policy):
    placement = Placement(policy)
    assert placement.choose(b"k", []) is None
    alone = [Candidate("survivor", 100)]
    assert all(placement.choose(bytes([i]), alone) == "survivor" for i in range(10))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="routing policy"):
        Placement("random")
    with pytest.raises(ValueError, match="load_factor"):
        Placement("prefix", load_factor=0.5)
