"""The engines' heartbeats, a part of `EngineClient` (`frontend.engine_client.client`).

Each engine's DEALER carries this frontend's pings out and the engine's stats back; the
stats are its heartbeat (`_stats_loop`). A socket monitor sees a dropped connection at once
(`_monitor_loop`); the ping loop finds the engines gone silent (`_ping_loop`). The frontend's
own stalls (stopped, or starved on a loaded host) are not counted against the engines.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from frontend.engine_client.connection import EngineConnection
from frontend.engine_client.consistency import mismatch
from shared.codec import encode, frontend_inbound_decoder
from shared.protocol import (
    AbortRequest,
    EngineCommandResult,
    EngineStats,
    LoraUpdateResult,
    Ping,
)

log = logging.getLogger("sluice.frontend")

STALL_S = 1.0  # the ping loop this much later than its interval: this frontend stalled


class EngineHeartbeats:
    """`EngineClient`'s heartbeat loops: they run on its engines, streams and settings."""

    async def _ping_loop(self) -> None:
        while True:
            ping = encode(Ping(sender_id=self.frontend_id, sent_at=time.time()))
            for conn in list(self.engines.values()):
                if self.engines.get(conn.address) is conn:  # not dropped meanwhile
                    await conn.dealer.send(ping)
            slept = time.monotonic()
            await asyncio.sleep(self.heartbeat_interval_s)
            self._forgive_own_stall(time.monotonic() - slept - self.heartbeat_interval_s)
            for conn in list(self.engines.values()):
                alive = conn.alive(self.heartbeat_timeout_s)
                if conn.was_alive and not alive:
                    # Silent, not gone (its socket is up): it may answer again, draining
                    # or not, and finish what it runs.
                    await self._engine_lost(conn, "drain" if conn.draining else "freeze",
                                            silent=True)
                conn.was_alive = alive
                self._drop_if_retired(conn)
            await self._place_waiting()

    def _forgive_own_stall(self, late_s: float) -> None:
        """The ping loop woke `late_s` after its time: past STALL_S this frontend itself did
        not run (stopped, or starved on a loaded host) and heard nothing meanwhile. The
        silence is its own, so every engine's clock moves on by it rather than the engines
        being taken for frozen (as the engine's PeerWatch does for its frontends)."""
        if late_s <= STALL_S:
            return
        for conn in self.engines.values():
            if conn.last_heard > 0:  # 0: never heard, or its connection dropped
                conn.last_heard += late_s

    async def _monitor_loop(self, conn: EngineConnection, monitor) -> None:
        """A dropped connection is a dead engine (a frozen one keeps its socket): known at
        once, not a heartbeat timeout later."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            # Also when it had frozen first: requests waiting for it must not wait for a
            # restarted engine on its address, which never heard of them.
            holds = any(s.engine is conn for s in self._streams.values())
            if event["event"] == zmq.EVENT_DISCONNECTED and (conn.was_alive or holds):
                conn.last_heard = 0.0
                conn.was_alive = False
                await self._engine_lost(conn, "drain" if conn.draining else "death")
                return  # that reconnected it: a new monitor watches the new socket

    async def _stats_loop(self, conn: EngineConnection) -> None:
        decoder = frontend_inbound_decoder()
        while True:
            message = decoder.decode(await conn.dealer.recv())
            if isinstance(message, LoraUpdateResult):
                self.lora_replies.deliver(message)
            elif isinstance(message, EngineCommandResult):
                self.command_replies.deliver(message)
            elif isinstance(message, EngineStats):
                conn.stats = message
                conn.own_at_stats = len(conn.requests)
                if self.kv_events is not None:  # --routing kv: its events, where it says
                    self.kv_events.follow(conn.address, conn.address, message.kv_events_endpoint,
                                          message.kv_events_replay_endpoint)
                conn.last_heard = time.monotonic()
                if self._refused(conn, message):
                    continue
                if not conn.was_alive:
                    # Said here, as it becomes live, so it comes before the "ready" line.
                    conn.was_alive = True
                    log.info("engine %s at %s is live", conn.engine_id, conn.address,
                             extra={"engine_id": conn.engine_id})
                if not message.draining and not conn.retired:
                    self.last_live = conn.last_heard
                if conn.orphans:
                    orphans, conn.orphans = sorted(conn.orphans), set()
                    log.info("engine %s answers again; aborting the %d requests failed "
                             "while it was silent (or moved to another engine)",
                             conn.engine_id, len(orphans))
                    await conn.dealer.send(encode(AbortRequest(orphans)))
                conn.stats_arrived.set()
                conn.stats_arrived = asyncio.Event()

    def _refused(self, conn: EngineConnection, stats: EngineStats) -> bool:
        """Another model or tokenizer than this frontend's: never live here. Logged once
        each time the verdict changes."""
        reason = mismatch(self.identity, stats)
        if reason != conn.refusal:
            if reason is not None:
                log.error("refusing engine at %s: %s", conn.address, reason)
            else:
                log.info("engine %s at %s now serves this frontend's model and tokenizer",
                         conn.engine_id, conn.address)
            conn.refusal = reason
        if reason is not None:
            conn.stats_arrived.set()
            conn.stats_arrived = asyncio.Event()
        return reason is not None

    async def refresh_stats(self, timeout_s: float = 1.0) -> None:
        """Ask the live engines for their stats now, so a scrape never shows a second-old
        picture."""
        ping = encode(Ping(sender_id=self.frontend_id, sent_at=time.time()))
        waits = []
        for conn in self.live_engines():
            waits.append(conn.stats_arrived.wait())
            await conn.dealer.send(ping)
        if waits:
            # An engine busy or gone: the heartbeat's picture has to do.
            tasks = [asyncio.ensure_future(w) for w in waits]
            await asyncio.wait(tasks, timeout=timeout_s)
            for task in tasks:
                task.cancel()
