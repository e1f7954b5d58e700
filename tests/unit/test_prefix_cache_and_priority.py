"""Prefix caching (chained page hashes rooted at cache_salt) and the priority policy, on the
tiny random Llama of engine_builders: no sockets, no real checkpoint."""

import msgspec
import pytest

from engine.step.kv_cache import PageAllocator, chain_hash, root_hash
from tests.unit.engine_builders import build_core, drain, random_weights, request

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights():
    return random_weights()


PROMPT = [(7 * i + 3) % 120 for i in range(37)]  # 9 full pages of 4, and one token more


def _generate(core, request_id, prompt, **params):
    core.add(request(request_id, prompt, **params))
    return drain(core)[request_id]


def test_cache_hit_skips_cached_pages_and_gives_identical_tokens(weights):
    core, _ = build_core(weights, page_size=4)
    first = _generate(core, "a", PROMPT)
    computed_before = core.num_computed_tokens
    second = _generate(core, "b", PROMPT)
    assert second.tokens == first.tokens
    # 36 of the 37 prompt tokens sit in full pages: only the last one is fed again,
    # then one decode per further token.
    fed = core.num_computed_tokens - computed_before
    assert fed == 1 + (len(second.tokens) - 1)
    assert core.allocator.prefix_hits >= 36


def test_partial_prefix_hit_only_reuses_matching_pages(weights):
    core, _ = build_core(weights, page_size=4)
    _generate(core, "a", PROMPT)
    hits = core.allocator.prefix_hits
    changed = PROMPT[:10] + [119] + PROMPT[11:]  # differs inside the third page
    fresh, _ = build_core(weights, page_size=4)
    assert _generate(core, "b", changed).tokens == _generate(fresh, "b", changed).tokens
    assert core.allocator.prefix_hits - hits == 8  # the two pages before the change


def test_different_salts_never_share_pages(weights):
    core, _ = build_core(weights, page_size=4)
    a = _generate(core, "a", PROMPT, max_tokens=4)
    before = core.allocator.prefix_hits
    core.add(msgspec.structs.replace(request("b", PROMPT, max_tokens=4), cache_salt="tenant-b"))
    b = drain(core)["b"]
    assert core.allocator.prefix_hits == before
    assert b.tokens == a.tokens  # same answer, computed from scratch
    core.add(msgspec.structs.replace(request("c", PROMPT, max_tokens=4), cache_salt="tenant-b"))
    drain(core)
    assert core.allocator.prefix_hits - before >= 36  # same salt: shared


def test_chain_hash_depends_on_salt_and_every_earlier_token():
    root_a, root_b = root_hash(None), root_hash("x")
    assert root_a != root_b
    page = [1, 2, 3, 4]
    assert chain_hash(root_a, page) != chain_hash(root_b, page)
    assert chain_hash(chain_hash(root_a, [9, 2, 3, 4]), page) != chain_hash(
        chain_hash(root_a, [1, 2, 3, 4]), page
    )


def test_cached_free_pages_are_recycled_oldest_first():
    alloc = PageAllocator(num_pages=3, page_size=2)
    pages = alloc.allocate(3)
    for i, page in enumerate(pages):
        alloc.register(page, bytes([i]) * 16)
    alloc.release(pages)
    assert alloc.num_free == 3  # cached pages nobody owns count as free
    (recycled,) = alloc.allocate(1)
    assert recycled == pages[0]
    assert alloc.cached_prefix([bytes([0]) * 16]) == []  # its hash left with it
    assert alloc.cached_prefix([bytes([1]) * 16, bytes([2]) * 16]) == pages[1:]


def test_all_pages_return_after_cached_reuse(weights):
    core, _ = build_core(weights, page_size=4)
    for i in range(3):
        _generate(core, f"r{i}", PROMPT)
    assert core.allocator.num_free == core.allocator.num_pages


def test_priority_policy_runs_lower_priority_values_first(weights):
    core, _ = build_core(weights, max_num_seqs=1, policy="priority")
    order = []
    for request_id, priority in [("low", 5), ("high", -1), ("mid", 2), ("high2", -1)]:
        core.add(msgspec.structs.replace(request(request_id, PROMPT[:5], max_tokens=2),
                                         priority=priority))
    while core.has_work:
        for _, out in core.step():
            if out.finish_reason is not None:
                order.append(out.request_id)
    assert order == ["high", "high2", "mid", "low"]


def test_fcfs_policy_ignores_priority(weights):
    core, _ = build_core(weights, max_num_seqs=1, policy="fcfs")
    order = []
    for request_id, priority in [("a", 5), ("b", -1), ("c", 2)]:
        core.add(msgspec.structs.replace(request(request_id, PROMPT[:5], max_tokens=2),
                                         priority=priority))
    while core.has_work:
        for _, out in core.step():
            if out.finish_reason is not None:
                order.append(out.request_id)
    assert order == ["a", "b", "c"]
