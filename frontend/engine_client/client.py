"""The frontend's side of the engine connections.

A frontend talks to every engine it is given (`--engine-address`, repeatable; a
`dns+tcp://NAME:PORT` stands for every address NAME resolves to, re-resolved every few
seconds, so engines join and leave without a restart). Each engine gets its own DEALER
connected to the engine's ROUTER: requests and aborts go out on it, pings ride it and the
engine's stats come back on it, which doubles as that engine's heartbeat.
`frontend.engine_client.placement` picks the engine for each request among the live ones; the
engine that took a request gets its aborts and stop-string finishes.

Migration: when an engine dies (its connection drops, seen at once by a socket monitor) or
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

Outputs arrive on this frontend's own PULL socket (`reply_to`), read by a receiver thread:
text frames from postproc workers, or token batches that it post-processes itself (when
there is no fleet, or every worker died), so the event loop only gets finished frames, one
hop per batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.engine_client.lora_client import LoraReplies, engines_with
from frontend.engine_client.placement import Candidate, Placement, prefix_key
from frontend.engine_client.tracking import RequestTracker
from postproc.processor import OutputProcessor
from shared.codec import encode, frontend_inbound_decoder
from shared.protocol import (
    AbortRequest,
    Continuation,
    EngineRequest,
    EngineStats,
    FrameBatch,
    LoraUpdateResult,
    OutputBatch,
    Ping,
    TextFrame,
)
from shared.transport import (
    is_dns_address,
    make_socket,
    new_ipc_address,
    resolve_host,
    split_dns_address,
    tcp_address,
)

log = logging.getLogger("sluice.frontend")

LOST_MESSAGE = "the engine stopped responding"  # the error of a request that cannot move
MIGRATION_REASONS = ("death", "freeze", "drain")
STALL_S = 1.0  # the ping loop this much later than its interval: this frontend stalled

Resolver = Callable[[str, int], list[str]]  # (name, port) -> IP addresses


class EngineUnavailable(Exception):
    pass


class EngineConnection:
    """One engine: its socket, its last stats (the heartbeat) and the requests on it."""

    def __init__(self, address: str, source: str) -> None:
        self.address = address  # what the DEALER connects to
        self.source = source  # the --engine-address it came from
        self.dealer: zmq.asyncio.Socket | None = None
        self.stats: EngineStats | None = None
        self.last_heard = 0.0
        self.was_alive = False
        self.retired = False  # its name no longer resolves to it: no new requests
        self.requests: set[str] = set()  # wire ids this frontend has running there
        self.own_at_stats = 0  # len(requests) when the last stats arrived
        # Requests failed or moved because it went silent: if it comes back (it was
        # frozen, not dead) it must drop them, so their aborts go out once it answers.
        self.orphans: set[str] = set()
        self.stats_task: asyncio.Task | None = None
        self.monitor: zmq.asyncio.Socket | None = None  # the dealer's disconnect events
        self.monitor_task: asyncio.Task | None = None
        self.stats_arrived = asyncio.Event()

    @property
    def draining(self) -> bool:
        """It said it is shutting down: it finishes what it runs and takes nothing new."""
        return self.stats is not None and self.stats.draining

    @property
    def engine_id(self) -> str:
        return self.stats.engine_id if self.stats is not None else self.address

    def alive(self, timeout_s: float) -> bool:
        return time.monotonic() - self.last_heard < timeout_s

    def load(self) -> int:
        """Waiting + running from its heartbeat, plus what this frontend sent since."""
        own = len(self.requests)
        if self.stats is None:
            return own
        return max(own, self.stats.num_running + self.stats.num_waiting + own - self.own_at_stats)

    def kv_use(self) -> float:
        stats = self.stats
        if stats is None or stats.num_total_pages <= 0:
            return 0.0
        return 1.0 - stats.num_free_pages / stats.num_total_pages


class RequestStream(msgspec.Struct):
    queue: asyncio.Queue
    request: EngineRequest  # as first sent: a move sends it again as a continuation
    prompt_ids: object
    next_seq: int = 0
    finished: bool = False
    # Where it runs and under which id (each attempt gets a new one); engine None: its
    # engine died and it waits for another (since `waiting_since`).
    engine: EngineConnection | None = None
    wire_id: str = ""
    attempts: int = 0
    moves: int = 0  # times it moved after its first frame (--migration-limit)
    waiting_since: float | None = None  # lost its engine with nowhere to go
    lost_reason: str = ""  # why it is waiting: death | freeze | drain
    # What the client has: the tokens of the frames delivered, and how many each held.
    output_ids: bytearray = msgspec.field(default_factory=bytearray)
    frame_sizes: list[int] = msgspec.field(default_factory=list)
    cumulative_logprob: float = 0.0

    def continuation(self) -> Continuation | None:
        if not self.frame_sizes:
            return None
        return Continuation(bytes(self.output_ids), list(self.frame_sizes),
                            self.cumulative_logprob)


class EngineClient:
    def __init__(
        self,
        engine_address: str | list[str],
        processor: OutputProcessor,
        result_address: str | None = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        routing: str = "prefix",
        resolver: Resolver | None = None,
        resolve_interval_s: float = 5.0,
        engine_timeout_s: float = 30.0,
        migration_limit: int = 3,
    ) -> None:
        sources = [engine_address] if isinstance(engine_address, str) else list(engine_address)
        if not sources:
            raise ValueError("at least one engine address is needed")
        for source in sources:
            if is_dns_address(source):
                split_dns_address(source)  # fails now, naming it, if malformed
        self.engine_sources = sources
        self.engine_address = " ".join(sources)  # for logs
        self.result_address = result_address or new_ipc_address("frontend")
        self.processor = processor
        self.heartbeat_interval_s = heartbeat_interval_s
        # Silent this long: not live (no new requests; its requests move if they can).
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # How long requests wait for an engine when none is live, then fail.
        self.engine_timeout_s = engine_timeout_s
        self.migration_limit = migration_limit
        self.placement = Placement(routing)
        self.resolver: Resolver = resolver or resolve_host
        self.resolve_interval_s = resolve_interval_s
        self.frontend_id = f"frontend-{uuid.uuid4().hex[:8]}"
        self.engines: dict[str, EngineConnection] = {}  # by address
        self._streams: dict[str, RequestStream] = {}  # by the pipeline's request id
        self._aliases: dict[str, str] = {}  # wire id of a resubmission -> request id
        self._ctx = zmq.asyncio.Context()
        self._stopping = threading.Event()
        self._tasks: list[asyncio.Task] = []
        self._sends: set[asyncio.Future] = set()
        self.tracker = RequestTracker(self)  # request metrics and timeouts
        self.migrated = dict.fromkeys(MIGRATION_REASONS, 0)  # requests moved, by why
        self.migration_failures = 0  # requests that had to move and could not
        self.last_live = 0.0  # time.monotonic() when an engine was last live
        self.lora_replies = LoraReplies()  # run-time adapter loads (lora_client.py)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._resolve()
        bound = threading.Event()
        self._receiver = threading.Thread(
            target=self._receive_outputs, args=(bound,), name="frontend-recv", daemon=True
        )
        self._receiver.start()
        bound.wait()
        self._tasks = [asyncio.create_task(self._ping_loop())]
        if any(is_dns_address(s) for s in self.engine_sources):
            self._tasks.append(asyncio.create_task(self._resolve_loop()))

    def _connect(self, conn: EngineConnection) -> None:
        conn.dealer = make_socket(self._ctx, zmq.DEALER)
        if conn.address.startswith("tcp://["):
            conn.dealer.setsockopt(zmq.IPV6, 1)
        conn.monitor = conn.dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        conn.dealer.connect(conn.address)
        conn.stats_task = asyncio.create_task(self._stats_loop(conn))
        conn.monitor_task = asyncio.create_task(self._monitor_loop(conn, conn.monitor))

    def _disconnect(self, conn: EngineConnection) -> None:
        for task in (conn.stats_task, conn.monitor_task):
            if task is not None:
                task.cancel()
        if conn.monitor is not None:  # closed here, not when its task ends: stop() terms
            conn.dealer.disable_monitor()
            conn.monitor.close(linger=0)
        if conn.dealer is not None:
            conn.dealer.close(linger=0)

    def _reconnect(self, conn: EngineConnection) -> None:
        """A fresh connection after the engine was lost: what the old one still queued
        (requests whose streams already failed or moved) must not reach a restarted engine,
        which would generate them for nobody."""
        self._disconnect(conn)
        self._connect(conn)

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        self._receiver.join(timeout=2)
        for conn in self.engines.values():
            self._disconnect(conn)
        self._ctx.term()

    # ---------------------------------------------------------------- engines

    async def _resolve(self) -> None:
        """Bring the connections in line with what the addresses name now."""
        wanted: dict[str, str] = {}
        for source in self.engine_sources:
            if not is_dns_address(source):
                wanted.setdefault(source, source)
                continue
            host, port = split_dns_address(source)
            try:
                ips = await self._loop.run_in_executor(None, self.resolver, host, port)
            except Exception as exc:  # noqa: BLE001 - DNS trouble must not stop serving
                log.warning("resolving %s failed (%s); keeping its %d engines", source, exc,
                            sum(c.source == source for c in self.engines.values()))
                for conn in self.engines.values():
                    if conn.source == source:
                        wanted.setdefault(conn.address, source)
                continue
            for ip in ips:
                wanted.setdefault(tcp_address(ip, port), source)
        for address, source in wanted.items():
            conn = self.engines.get(address)
            if conn is None:
                conn = self.engines[address] = EngineConnection(address, source)
                self._connect(conn)
                log.info("engine at %s (from %s): connecting", address, source)
            elif conn.retired:
                log.info("engine at %s is back in %s", address, source)
            conn.retired = False
        for conn in list(self.engines.values()):
            if conn.address not in wanted and not conn.retired:
                conn.retired = True
                log.info("engine %s at %s left %s: no new requests go there",
                         conn.engine_id, conn.address, conn.source)
            self._drop_if_retired(conn)

    def _drop_if_retired(self, conn: EngineConnection) -> None:
        if conn.retired and not conn.requests:
            self._disconnect(conn)
            del self.engines[conn.address]

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            await self._resolve()

    def live_engines(self) -> list[EngineConnection]:
        """The engines new work may go to: heard lately, not retired, not draining."""
        return [c for c in self.engines.values()
                if c.alive(self.heartbeat_timeout_s) and not c.retired and not c.draining]

    @property
    def engine_alive(self) -> bool:
        """Whether any engine answers: the frontend can serve."""
        return bool(self.live_engines())

    @property
    def may_serve(self) -> bool:
        """Whether a request may be taken: an engine is live, or one was within
        --engine-timeout (it froze or restarts: requests wait for it)."""
        return self.engine_alive or (
            self.last_live > 0 and time.monotonic() - self.last_live < self.engine_timeout_s)

    @property
    def stats(self) -> EngineStats | None:
        """A live engine's latest stats (the model's facts: max_model_len, the name), else
        the latest any engine sent; None before any did."""
        ordered = sorted(self.engines.values(), key=lambda c: c.address)
        for conn in [*self.live_engines(), *ordered]:
            if conn.stats is not None:
                return conn.stats
        return None

    def engine_states(self) -> list[tuple[str, str, bool, EngineStats | None]]:
        """(engine id, address, alive, last stats) of every engine, for /metrics."""
        return [(c.engine_id, c.address, c.alive(self.heartbeat_timeout_s), c.stats)
                for c in sorted(self.engines.values(), key=lambda c: c.address)]

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
            elif isinstance(message, EngineStats):
                conn.stats = message
                conn.own_at_stats = len(conn.requests)
                conn.last_heard = time.monotonic()
                if not conn.was_alive:
                    # Said here, as it becomes live, so it comes before the "ready" line.
                    conn.was_alive = True
                    log.info("engine %s at %s is live", conn.engine_id, conn.address)
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
            log.error("engine %s at %s stopped answering; its %d requests wait for it (or "
                      "another engine) up to --engine-timeout %gs", conn.engine_id,
                      conn.address, len(mine), self.engine_timeout_s)
            return
        conn.orphans.update(s.wire_id for _, s in mine)
        conn.requests.clear()
        log.error("engine %s at %s is gone (%s); moving its %d requests", conn.engine_id,
                  conn.address, reason, len(mine))
        for request_id, stream in mine:
            stream.engine = None
            stream.waiting_since, stream.lost_reason = now, reason
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
        stream.waiting_since = None
        log.warning("request %s (%s) moved to engine %s as %s after %d tokens (%s)",
                    request_id, old_wire, target.engine_id, stream.wire_id,
                    len(stream.output_ids) // 4, stream.lost_reason)

    # ---------------------------------------------------------------- requests

    def _place(self, request: EngineRequest, live: list[EngineConnection]) -> EngineConnection:
        live = engines_with(live, request.lora_name)
        names: dict[str, EngineConnection] = {}
        for conn in live:
            name = conn.engine_id
            if name in names:  # two engines calling themselves the same: keep both apart
                name = f"{name}|{conn.address}"
            names[name] = conn
        page_size = next((getattr(c.stats, "page_size", 0) for c in live
                          if c.stats is not None and getattr(c.stats, "page_size", 0)), 16)
        key = prefix_key(request.prompt_token_ids, request.cache_salt, page_size)
        chosen = self.placement.choose(key, [
            Candidate(name=name, load=c.load(), kv_use=c.kv_use(),
                      waiting=c.stats.num_waiting if c.stats is not None else 0)
            for name, c in names.items()])
        return names[chosen]

    async def _send_to(self, conn: EngineConnection, request_id: str,
                       stream: RequestStream, request: EngineRequest) -> None:
        if stream.attempts > 0:
            # A new id for each further attempt: a late frame of a lost one is dropped. The
            # random part keeps it from being any other request's id (clients choose ids).
            self.processor.discard(stream.wire_id)
            stream.wire_id = f"{request_id}~{stream.attempts}-{uuid.uuid4().hex[:8]}"
            self._aliases[stream.wire_id] = request_id
            request = msgspec.structs.replace(request, request_id=stream.wire_id)
        else:
            stream.wire_id = request_id
        stream.attempts += 1
        stream.engine = conn
        conn.requests.add(stream.wire_id)
        self.processor.register(stream.wire_id, stream.prompt_ids, request.output,
                                request.continuation)
        await conn.dealer.send(encode(request))

    async def submit(self, request: EngineRequest, prompt_ids, queue: asyncio.Queue) -> None:
        """Send a request; its TextFrames will arrive on `queue` (which several may share).
        With no live engine but one live within --engine-timeout (frozen, restarting,
        draining away), it waits for one that long."""
        live = await self._wait_for_live()
        if not live:
            raise EngineUnavailable("no engine is connected")
        stream = RequestStream(queue, request, prompt_ids)
        self._streams[request.request_id] = stream
        self.tracker.submitted(request)
        await self._send_to(self._place(request, live), request.request_id, stream, request)

    async def _wait_for_live(self) -> list[EngineConnection]:
        while not (live := self.live_engines()):
            left = self.last_live + self.engine_timeout_s - time.monotonic()
            if self.last_live == 0.0 or left <= 0:
                return []
            await asyncio.sleep(min(left, 0.1))
        return live

    def _forget(self, request_id: str) -> RequestStream | None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._aliases.pop(stream.wire_id, None)
            if stream.engine is not None:
                stream.engine.requests.discard(stream.wire_id)
        return stream

    async def abort(self, request_id: str) -> None:
        """Stop a request early; safe to call for finished or unknown ids."""
        stream = self._forget(request_id)
        self.tracker.ended(request_id, "abort")
        if stream is None:
            self.processor.discard(request_id)
            return
        self.processor.discard(stream.wire_id)
        if not stream.finished and stream.engine is not None:
            await stream.engine.dealer.send(encode(AbortRequest([stream.wire_id])))

    def in_flight(self, request_id: str) -> bool:
        """Whether this frontend already has a request with this id running."""
        return request_id in self._streams

    def release(self, request_id: str) -> None:
        self._forget(request_id)
        self.tracker.ended(request_id, None)

    # ---------------------------------------------------------------- outputs

    def _receive_outputs(self, bound: threading.Event) -> None:
        ctx = zmq.Context.instance()
        sock = make_socket(ctx, zmq.PULL)
        sock.bind(self.result_address)
        bound.set()
        decoder = frontend_inbound_decoder()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(100):
                continue
            message = decoder.decode(sock.recv(copy=False).buffer)
            stopped: list[str] = []
            if isinstance(message, OutputBatch):
                processed = self.processor.process(message.outputs)
                frames, stopped = processed.frames, processed.stopped_early
            elif isinstance(message, FrameBatch):
                frames = message.frames
            else:
                continue
            if frames:
                self._loop.call_soon_threadsafe(self._deliver, frames, stopped)
        sock.close(linger=0)

    def _stream_of(self, wire_id: str) -> tuple[str, RequestStream | None]:
        """The request id and stream a frame's id belongs to; None for a lost attempt."""
        request_id = self._aliases.get(wire_id, wire_id)
        stream = self._streams.get(request_id)
        if stream is None or stream.wire_id != wire_id:
            return request_id, None
        return request_id, stream

    def _deliver(self, frames: list[TextFrame], stopped_early: list[str]) -> None:
        if stopped_early:
            # A stop string ended these; their engines are still generating them.
            by_engine: dict[str, list[str]] = {}
            for wire_id in stopped_early:
                _, stream = self._stream_of(wire_id)
                if stream is not None and stream.engine is not None:
                    by_engine.setdefault(stream.engine.address, []).append(wire_id)
            for address, wire_ids in by_engine.items():
                send = asyncio.ensure_future(
                    self.engines[address].dealer.send(encode(AbortRequest(wire_ids))))
                self._sends.add(send)  # keep a reference until it is done
                send.add_done_callback(self._sends.discard)
        for frame in frames:
            request_id, stream = self._stream_of(frame.request_id)
            if stream is None or frame.seq < stream.next_seq:
                continue  # gone, a lost attempt, or a duplicate from a replaying worker
            if frame.request_id != request_id:
                frame = msgspec.structs.replace(frame, request_id=request_id)
            stream.next_seq = frame.seq + 1
            stream.output_ids += frame.token_ids
            stream.frame_sizes.append(len(frame.token_ids) // 4)
            if frame.cumulative_logprob is not None:
                stream.cumulative_logprob = frame.cumulative_logprob
            if frame.finish_reason is not None:
                stream.finished = True
                self._forget(request_id)
                # A postproc worker did the work; drop the spec kept in case it died.
                self.processor.discard(stream.wire_id)
            self.tracker.delivered(frame)
            stream.queue.put_nowait(frame)

    def _end_with_error(self, request_id: str, stream: RequestStream, message: str,
                        status: int) -> None:
        self._forget(request_id)
        self.processor.discard(stream.wire_id)
        self._deliver_error(request_id, stream, message, status)

    def _deliver_error(self, request_id: str, stream: RequestStream, message: str,
                       status: int) -> None:
        """The request's last frame: an error its response reports."""
        frame = TextFrame(
            request_id=request_id, seq=stream.next_seq, text="", token_ids=b"",
            num_prompt_tokens=0, num_output_tokens=0, finish_reason="error",
            error=message, error_status=status,
        )
        self.tracker.delivered(frame)
        stream.queue.put_nowait(frame)

    # ---------------------------------------------------------------- limits

    def active_request_ids(self) -> list[str]:
        return list(self._streams)

    async def fail_request(self, request_id: str, message: str, status: int) -> None:
        """End one running request with an error frame (its response says why) and abort it
        in the engine: used by --request-timeout and at the end of a drain."""
        stream = self._streams.get(request_id)
        if stream is None:
            return  # finished meanwhile
        self._deliver_error(request_id, stream, message, status)
        await self.abort(request_id)
