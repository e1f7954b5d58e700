"""The engines' KV events since they were last read, for TensorRT-LLM's POST /kv_cache_events.

The frontend's one KV-event subscriber (`kv_events.py`) records every batch it applies
here, per engine (by address), each event numbered: its `event_id`, counting up per engine
for this frontend's life. A hole in those numbers tells the reader events were lost: the
subscriber found a hole in the engine's own sequence no replay filled (`gap`), or the
journal overflowed because nobody read it (the oldest go first, as trtllm-serve's bounded
event buffer drops them). The subscriber thread writes and the event loop drains: a lock
keeps them apart.
"""

from __future__ import annotations

import threading
from collections import deque

import msgspec

from shared.kv_events import KVEvent, KVEventBatch

MAX_EVENTS_PER_ENGINE = 10_000  # kept unread per engine (trtllm-serve's event_buffer_max_size)


class JournalEntry(msgspec.Struct, frozen=True, gc=False):
    engine: str  # the engine's address
    event_id: int
    data_parallel_rank: int | None
    event: KVEvent


class KvJournal:
    def __init__(self, max_events: int = MAX_EVENTS_PER_ENGINE) -> None:
        self.max_events = max_events
        self._entries: dict[str, deque[JournalEntry]] = {}
        self._next_id: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, engine: str, batch: KVEventBatch) -> None:
        with self._lock:
            entries = self._entries.get(engine)
            if entries is None:
                entries = self._entries[engine] = deque(maxlen=self.max_events)
            first = self._next_id.get(engine, 0)
            for i, event in enumerate(batch.events):
                entries.append(JournalEntry(engine, first + i, batch.data_parallel_rank, event))
            self._next_id[engine] = first + len(batch.events)

    def gap(self, engine: str) -> None:
        """Events were lost: the next event_id skips one, so the reader sees the hole."""
        with self._lock:
            self._next_id[engine] = self._next_id.get(engine, 0) + 1

    def drain(self) -> list[JournalEntry]:
        """Every engine's unread events, engine by engine (by address), each in order."""
        with self._lock:
            drained = [e for engine in sorted(self._entries) for e in self._entries[engine]]
            self._entries = {}
        return drained
