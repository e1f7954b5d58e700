"""Which engine holds which KV pages, as their KV events say (`--routing kv`).

The subscriber thread (`kv_events.py`) applies each engine's event batches; placement asks,
on the event loop, how long a run of a prompt's leading pages each engine holds. A lock
keeps the two apart; each call holds it for one batch or one prompt's lookup.

Only the engines' own pool (medium GPU, vLLM's name for it) counts: a page an offload tier
holds would have to be brought back first. An engine that sends more pages than
`max_pages` without removing any (no real cache does) has its entries dropped, so a bad
peer cannot grow a frontend without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from shared.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

MAX_PAGES_PER_ENGINE = 1 << 22


class KvIndex:
    def __init__(self, max_pages: int = MAX_PAGES_PER_ENGINE) -> None:
        self.max_pages = max_pages
        self._holders: dict[int, set[str]] = {}  # page hash -> engines holding it
        self._pages: dict[str, set[int]] = {}  # engine -> the page hashes it holds
        self._lock = threading.Lock()

    def pages_of(self, engine: str) -> int:
        with self._lock:
            return len(self._pages.get(engine, ()))

    def apply(self, engine: str, batch: KVEventBatch) -> None:
        with self._lock:
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self._drop(engine)
                elif event.medium not in (None, MEDIUM_GPU):
                    continue
                elif isinstance(event, BlockStored):
                    self._store(engine, event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._remove(engine, event.block_hashes)

    def drop(self, engine: str) -> None:
        """Forget what `engine` holds: it was lost, or its events have a hole in them."""
        with self._lock:
            self._drop(engine)

    def longest_runs(self, hashes: Iterable[int], engines: list[str]) -> dict[str, int]:
        """For each of `engines`, how many of the leading `hashes` it holds in a row; stops
        reading `hashes` (a lazy iterable) once no engine goes on."""
        runs = dict.fromkeys(engines, 0)
        going = set(engines)
        with self._lock:
            for h in hashes:
                going &= self._holders.get(h, set())
                if not going:
                    break
                for engine in going:
                    runs[engine] += 1
        return runs

    # ---------------------------------------------------------------- under the lock

    def _store(self, engine: str, hashes: list[int]) -> None:
        pages = self._pages.setdefault(engine, set())
        for h in hashes:
            pages.add(h)
            self._holders.setdefault(h, set()).add(engine)
        if len(pages) > self.max_pages:
            self._drop(engine)

    def _remove(self, engine: str, hashes: list[int]) -> None:
        pages = self._pages.get(engine)
        if pages is None:
            return
        for h in hashes:
            pages.discard(h)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(engine)
                if not holders:
                    del self._holders[h]

    def _drop(self, engine: str) -> None:
        for h in self._pages.pop(engine, ()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(engine)
                if not holders:
                    del self._holders[h]
