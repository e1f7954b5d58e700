"""Migration, a part of `EngineClient` (`frontend.engine_client.client`).

When an engine dies (its connection drops, seen at once by a socket monitor) or
stays silent past the heartbeat timeout while another engine is live, each of its requests
moves to a live engine as a continuation (`Continuation`: the tokens the client already has,
grouped as its frames), so the client's stream goes on with the next token. Each attempt
has its own wire id (`request~N-xxxx`, the request's epoch): a late frame of a lost attempt
is dropped, and the engine it was on is told to abort it (freeing its KV pages) when it
answers again. With no engine to go to, requests wait up to --engine-timeout for one (a
frozen engine that wakes simply goes on with them; new requests wait too), then end with an
error. A started request moves at most --migration-limit times. A draining engine (SIGTERM)
takes no new requests; what it still runs when it exits moves. One that goes silent while it
drains is a frozen engine like any other: with nowhere to move, its requests wait for it and
go on there when it answers. The frontend's own stalls (stopped, or starved on a loaded host)
are not counted against the engines.
"""

from __future__ import annotations

import logging
import time

import msgspec

from frontend.engine_client.connection import EngineConnection, RequestStream

log = logging.getLogger("sluice.frontend")

LOST_MESSAGE = "the engine stopped responding"  # the error of a request that cannot move
MIGRATION_REASONS = ("death", "freeze", "drain")


class Migration:
    """`EngineClient`'s moves of requests whose engine was lost."""

    async def _engine_lost(self, conn: EngineConnection, reason: str,
                           silent: bool = False) -> None:
        """`conn` died, froze or drained away: its requests move to live engines. A silent
        engine (frozen, draining or not) with none to take over keeps them (it may wake:
        they wait, see `_place_waiting`); a dead one's wait for an engine without it."""
        mine = [(rid, s) for rid, s in self._streams.items() if s.engine is conn]
        others = [c for c in self.live_engines() if c is not conn]
        now = time.monotonic()
        if silent and not others:
            for _, stream in mine:
                stream.waiting_since, stream.lost_reason = now, reason
                stream.lost_from = conn
            log.error("engine %s at %s stopped answering; its %d requests wait for it (or "
                      "another engine) up to --engine-timeout %gs", conn.engine_id,
                      conn.address, len(mine), self.engine_timeout_s,
                      extra={"engine_id": conn.engine_id})
            return
        conn.orphans.update(s.wire_id for _, s in mine)
        conn.requests.clear()
        log.error("engine %s at %s is gone (%s); moving its %d requests", conn.engine_id,
                  conn.address, reason, len(mine), extra={"engine_id": conn.engine_id})
        for request_id, stream in mine:
            stream.engine = None
            stream.waiting_since, stream.lost_reason = now, reason
            stream.lost_from = conn
            await self._move(request_id, stream, others)
        self._reconnect(conn)

    async def _place_waiting(self) -> None:
        """Each tick: requests that lost their engine go on where they can (their frozen
        engine woke, or another is live), or fail once they waited --engine-timeout. A
        woken engine that drains takes nothing new, but goes on with what it holds."""
        live = self.live_engines()
        now = time.monotonic()
        for request_id, stream in list(self._streams.items()):
            if stream.waiting_since is None:
                continue
            home = stream.engine
            if home is not None and home.alive(self.heartbeat_timeout_s):
                log.info("engine %s answers again: request %s goes on there",
                         home.engine_id, request_id)
                stream.waiting_since = None
                continue
            if not live and now - stream.waiting_since < self.engine_timeout_s:
                continue
            if home is not None:  # frozen: it must drop the request should it wake
                home.orphans.add(stream.wire_id)
                home.requests.discard(stream.wire_id)
                stream.engine = None
            if live:
                await self._move(request_id, stream, live)
            else:
                self.migration_failures += 1
                self._end_with_error(request_id, stream, LOST_MESSAGE, 503)

    async def _move(self, request_id: str, stream: RequestStream,
                    live: list[EngineConnection]) -> None:
        """Send a request that lost its engine to one of `live` as a continuation; with
        none, it waits (`_place_waiting`); past --migration-limit it fails."""
        if stream.next_seq > 0 and stream.moves >= self.migration_limit:
            self.migration_failures += 1
            log.error("request %s cannot move: it moved %d times (--migration-limit %d)",
                      request_id, stream.moves, self.migration_limit)
            self._end_with_error(request_id, stream, LOST_MESSAGE, 503)
            return
        if not live:
            return  # it waits
        request = msgspec.structs.replace(stream.request, continuation=stream.continuation())
        target = self._place(request, live)
        old_wire = stream.wire_id
        self._aliases.pop(old_wire, None)
        await self._send_to(target, request_id, stream, request)
        if stream.next_seq > 0:
            stream.moves += 1
        self.migrated[stream.lost_reason] += 1
        target.migrated_in += 1
        if stream.lost_from is not None:
            stream.lost_from.migrated_out += 1
            stream.lost_from = None
        stream.waiting_since = None
        log.warning("request %s (%s) moved to engine %s as %s after %d tokens (%s)",
                    request_id, old_wire, target.engine_id, stream.wire_id,
                    len(stream.output_ids) // 4, stream.lost_reason,
                    extra={"request_id": request_id, "engine_id": target.engine_id})
