"""TensorRT-LLM's POST /kv_cache_events: the engines' KV events since the last call, in
trtllm-serve's JSON (its KVCacheEventSerializer's field names).

Each event is `{"event_id", "data": {"type": ...}, "window_size"}` (plus `attention_dp_rank`,
the engine's data-parallel rank, and sluice's `engine_id`: one frontend may front several
engines). sluice's vLLM-wire events (`shared.kv_events`) map as:

- AllBlocksCleared -> `created`, the cache starting empty: `num_blocks_per_cache_level`
  [the engine's pages, 0] (primary and secondary levels; sluice has no secondary one);
- BlockStored -> `stored`: `parent_hash`, one `stored_block` per page with its tokens as
  `unique_token`s, `cache_level` 0 (1 for an offload tier's medium) and TensorRT-LLM's
  default retention `priority`, 35;
- BlockRemoved -> `removed`: `block_hashes`.

`updated` (a block's priority or level changing) never occurs: sluice moves no block.
`window_size` is the engine's max_model_len (full attention: TensorRT-LLM's window then).
"""

from __future__ import annotations

import msgspec

from frontend.engine_client.kv_journal import JournalEntry
from shared.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

DEFAULT_PRIORITY = 35  # TensorRT-LLM's KvCacheRetentionConfig default


class UniqueToken(msgspec.Struct, tag_field="type", tag="unique_token"):
    token_id: int
    token_extra_id: int = 0


class StoredBlock(msgspec.Struct, tag_field="type", tag="stored_block"):
    block_hash: int
    tokens: list[UniqueToken]
    cache_level: int
    priority: int


class CreatedData(msgspec.Struct, tag_field="type", tag="created"):
    num_blocks_per_cache_level: list[int]


class StoredData(msgspec.Struct, tag_field="type", tag="stored"):
    parent_hash: int | None
    blocks: list[StoredBlock]


class RemovedData(msgspec.Struct, tag_field="type", tag="removed"):
    block_hashes: list[int]


class KvCacheEvent(msgspec.Struct, omit_defaults=True):
    event_id: int
    data: CreatedData | StoredData | RemovedData
    window_size: int
    engine_id: str
    attention_dp_rank: int | None = None


def trtllm_events(entries: list[JournalEntry], engines: dict) -> list[KvCacheEvent]:
    """The journal's entries in trtllm-serve's shape; `engines` the client's connections by
    address (for each engine's id, pages and max_model_len)."""
    return [_event(e, engines.get(e.engine)) for e in entries]


def _event(entry: JournalEntry, conn) -> KvCacheEvent:
    stats = conn.stats if conn is not None else None
    engine_id = conn.engine_id if conn is not None else entry.engine
    return KvCacheEvent(entry.event_id, _data(entry.event, stats),
                        stats.max_model_len if stats is not None else 0, engine_id,
                        entry.data_parallel_rank)


def _data(event, stats) -> CreatedData | StoredData | RemovedData:
    if isinstance(event, AllBlocksCleared):
        return CreatedData([stats.num_total_pages if stats is not None else 0, 0])
    if isinstance(event, BlockRemoved):
        return RemovedData(list(event.block_hashes))
    assert isinstance(event, BlockStored)
    level = 0 if event.medium in (None, MEDIUM_GPU) else 1
    size = event.block_size
    blocks = [
        StoredBlock(h, [UniqueToken(t) for t in event.token_ids[i * size:(i + 1) * size]],
                    level, DEFAULT_PRIORITY)
        for i, h in enumerate(event.block_hashes)
    ]
    return StoredData(event.parent_block_hash, blocks)
