"""A background response's event stream, kept in the state store while the run produces it,
so `GET /v1/responses/{id}?stream=true&starting_after=N` replays it and then follows its live
end, from any frontend on the same store (as OpenAI's API resumes a background stream).

The events are the SSE byte strings the stream sends, numbered by their `sequence_number`
(0, 1, ...). They are kept in chunks of `CHUNK` events, one store entry per chunk
(`response-events:{id}:{k}`, a msgpack list), so the runner rewrites at most one small
entry per flush (every `FLUSH_S`) instead of the whole stream, and a reader finds event N in
chunk N // CHUNK. Followers poll the store (every `POLL_S`): the same code for a follower
on the frontend running the response as on any other.

Bounds: the kept events are at most `max_bytes` in all; past it, delta events are kept as
empty placeholders (their numbers stay, their text is in the `.done` events that follow),
so a replay skips them. They live as long as stored responses (`--responses-ttl`), at most
`EVENTS_TTL_S`, and go with the response when it is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from frontend.state.store import StateStore, StoreUnavailable, ValueTooLarge

log = logging.getLogger("sluice.frontend.events")
CHUNK = 64
FLUSH_S = 0.05  # the runner writes new events at most this often
POLL_S = 0.05  # a follower looks for new events this often
CHECK_S = 1.0  # ... and whether the response has ended without a final event this often
GRACE_S = 2.0  # how long a follower waits for a final event once the record is finished
EVENTS_TTL_S = 24 * 3600.0
# The events after which nothing follows.
TERMINAL = tuple(f"event: response.{end}\n".encode()
                 for end in ("completed", "incomplete", "failed"))

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[bytes]).decode


def _key(response_id: str, chunk: int) -> str:
    return f"response-events:{response_id}:{chunk}"


def _is_delta(event: bytes) -> bool:
    return event.split(b"\n", 1)[0].endswith(b".delta")


class EventLog:
    """The writer: the runner adds each event as it is made; `flush` stores the new ones."""

    def __init__(self, store: StateStore, response_id: str, ttl_s: float | None,
                 max_bytes: int) -> None:
        self.store = store
        self.response_id = response_id
        self.ttl_s = min(ttl_s or EVENTS_TTL_S, EVENTS_TTL_S)
        self.max_bytes = max_bytes
        self.events: list[bytes] = []
        self._bytes = 0
        self._flushed = 0  # events[:_flushed] are in the store
        self._last_flush = 0.0

    def add(self, event: bytes) -> None:
        if self._bytes + len(event) > self.max_bytes and _is_delta(event):
            event = b""  # over the bound: the number stays, the text is in the .done event
        self._bytes += len(event)
        self.events.append(event)

    async def flush(self, force: bool = False) -> None:
        """Stores the chunks that have new events; without `force`, at most every FLUSH_S.
        A store that is away is retried at the next flush (the events stay here)."""
        now = asyncio.get_running_loop().time()
        if self._flushed == len(self.events) or (not force and now - self._last_flush < FLUSH_S):
            return
        self._last_flush = now
        first, last = self._flushed // CHUNK, (len(self.events) - 1) // CHUNK
        for chunk in range(first, last + 1):
            try:
                await self.store.put(_key(self.response_id, chunk),
                                     _encode(self.events[chunk * CHUNK:(chunk + 1) * CHUNK]),
                                     self.ttl_s)
            except StoreUnavailable:
                return
            except ValueTooLarge:
                log.warning("events %d.. of %s are too large to store", chunk * CHUNK,
                            self.response_id)
        self._flushed = len(self.events)


async def count(store: StateStore, response_id: str) -> int:
    """How many events of the response are stored so far."""
    chunk = 0
    while True:
        raw = await store.get(_key(response_id, chunk))
        if raw is None:
            return chunk * CHUNK
        n = len(_decode(raw))
        if n < CHUNK:
            return chunk * CHUNK + n
        chunk += 1


async def forget(store: StateStore, response_id: str) -> None:
    for key in await store.scan(f"response-events:{response_id}:"):
        await store.delete(key)


async def follow(store: StateStore, response_id: str, after: int,
                 finished: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
    """The stored events numbered after `after`, then the new ones as they are stored, until
    the final event; or, when the response ended without one (cancelled, or its record
    written by a frontend that could not store the rest), GRACE_S after `finished()` first
    says so."""
    loop = asyncio.get_running_loop()
    if after >= 0:  # after the final event: nothing follows
        raw = await store.get(_key(response_id, after // CHUNK))
        if raw is not None and _decode(raw)[after % CHUNK].startswith(TERMINAL):
            return
    index = after + 1
    next_check, ended_at = loop.time() + CHECK_S, None
    while True:
        chunk, pos = divmod(index, CHUNK)
        try:
            raw = await store.get(_key(response_id, chunk))
        except StoreUnavailable:  # the stream has begun: wait for the store, not a 503
            await asyncio.sleep(CHECK_S)
            continue
        new = _decode(raw)[pos:] if raw is not None else []
        for event in new:
            if event:
                yield event
            if event.startswith(TERMINAL):
                return
        index += len(new)
        if new and index % CHUNK == 0:
            continue  # a full chunk: the next may be waiting
        now = loop.time()
        if now >= next_check:
            next_check = now + CHECK_S
            with contextlib.suppress(StoreUnavailable):
                if ended_at is None and await finished():
                    ended_at = now
        if ended_at is not None and now - ended_at > GRACE_S:
            return
        await asyncio.sleep(POLL_S)
