"""POST /kv_cache_events's journal and shape (the HTTP route over real engines is
tests/integration/test_kv_events.py's): the per-engine bound, the event_id hole a lost
batch or an overflow leaves, and the mapping of each vLLM-wire event to trtllm-serve's."""

from __future__ import annotations

import msgspec

from frontend.engine_client.kv_journal import KvJournal
from frontend.http.kv_cache_events import trtllm_events
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def _removed(h: int) -> BlockRemoved:
    return BlockRemoved([h], "GPU")


def test_the_journal_keeps_the_newest_events_per_engine_and_numbers_each():
    journal = KvJournal(max_events=3)
    journal.record("a", KVEventBatch(0.0, [_removed(i) for i in range(5)], 0))
    journal.record("b", KVEventBatch(0.0, [_removed(9)], 1))
    drained = journal.drain()
    assert [(e.engine, e.event_id) for e in drained] == [("a", 2), ("a", 3), ("a", 4), ("b", 0)]
    assert journal.drain() == []  # since the last call: nothing
    journal.gap("a")  # a hole in the engine's sequence shows as a hole in event_id
    journal.record("a", KVEventBatch(0.0, [_removed(7)], 0))
    assert [e.event_id for e in journal.drain()] == [6]


def test_each_event_in_trtllm_serves_shape():
    journal = KvJournal()
    stored = BlockStored([11, 12], 10, [1, 2, 3, 4], 2, None, "CPU", None)
    journal.record("tcp://x:1", KVEventBatch(0.0, [AllBlocksCleared(), stored, _removed(11)]))
    got = msgspec.to_builtins(trtllm_events(journal.drain(), {}))
    token = {"type": "unique_token", "token_extra_id": 0}
    # An engine the frontend no longer knows: its address names it, no pages, no window.
    assert got == [
        {"event_id": 0, "window_size": 0, "engine_id": "tcp://x:1",
         "data": {"type": "created", "num_blocks_per_cache_level": [0, 0]}},
        {"event_id": 1, "window_size": 0, "engine_id": "tcp://x:1",
         "data": {"type": "stored", "parent_hash": 10, "blocks": [
             {"type": "stored_block", "block_hash": 11, "cache_level": 1, "priority": 35,
              "tokens": [{**token, "token_id": 1}, {**token, "token_id": 2}]},
             {"type": "stored_block", "block_hash": 12, "cache_level": 1, "priority": 35,
              "tokens": [{**token, "token_id": 3}, {**token, "token_id": 4}]}]}},
        {"event_id": 2, "window_size": 0, "engine_id": "tcp://x:1",
         "data": {"type": "removed", "block_hashes": [11]}},
    ]
