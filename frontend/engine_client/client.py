"""The frontend's side of the engine connections.

A frontend talks to every engine it is given (`--engine-address`, repeatable; a
`dns+tcp://NAME:PORT` stands for every address NAME resolves to, re-resolved every few
seconds, so engines join and leave without a restart). Each engine gets its own DEALER
connected to the engine's ROUTER: requests and aborts go out on it, pings ride it and the
engine's stats come back on it, which doubles as that engine's heartbeat.
`frontend.engine_client.placement` picks the engine for each request among the live ones; the
engine that took a request gets its aborts and stop-string finishes.

Its parts: the per-engine and per-request state (`connection.py`), the heartbeats
(`heartbeats.py`), migration when an engine is lost (`migration.py`) and the outputs'
receiver thread (`receiver.py`); this module holds the connections and sends the requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from frontend.engine_client.admission import current_meter
from frontend.engine_client.connection import (
    EngineConnection,
    EngineUnavailable,
    RequestStream,
)
from frontend.engine_client.consistency import ServedIdentity
from frontend.engine_client.engine_commands import CommandReplies
from frontend.engine_client.heartbeats import EngineHeartbeats
from frontend.engine_client.kv_events import KvEventSubscriber
from frontend.engine_client.kv_index import KvIndex
from frontend.engine_client.kv_journal import KvJournal
from frontend.engine_client.lora_client import LoraReplies, engines_with
from frontend.engine_client.migration import MIGRATION_REASONS, Migration
from frontend.engine_client.placement import (
    Candidate,
    PinnedUnavailable,
    Placement,
    RoutingHints,
    conversation_key,
    prefix_key,
)
from frontend.engine_client.receiver import OutputReceiver
from frontend.engine_client.tracking import RequestTracker
from postproc.processor import OutputProcessor
from shared.codec import encode
from shared.page_hash import prompt_page_hashes
from shared.protocol import AbortRequest, EngineRequest, EngineStats
from shared.transport import (
    is_dns_address,
    make_socket,
    new_ipc_address,
    resolve_host,
    split_dns_address,
    tcp_address,
)

log = logging.getLogger("sluice.frontend")

Resolver = Callable[[str, int], list[str]]  # (name, port) -> IP addresses

__all__ = ["EngineClient", "EngineUnavailable"]  # EngineUnavailable: what submit raises


class EngineClient(EngineHeartbeats, Migration, OutputReceiver):
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
        # The engines' KV events, by engine address (kv_events.py): an index under
        # --routing kv, and the journal TensorRT-LLM's POST /kv_cache_events drains.
        self.kv_journal = KvJournal()
        self.kv_events = KvEventSubscriber(KvIndex() if routing == "kv" else None,
                                           self.kv_journal)
        # What this frontend renders for; engines serving something else are refused.
        self.identity: ServedIdentity | None = None
        self.command_replies = CommandReplies()  # profile and energy (engine_commands.py)

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
        if self.kv_events is not None:
            self.kv_events.start()
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
        if self.kv_events is not None:  # lost or gone: what it held is unknown now
            self.kv_events.forget(conn.address)
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
        if self.kv_events is not None:
            self.kv_events.stop()
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
                if c.alive(self.heartbeat_timeout_s) and not c.retired and not c.draining
                and c.refusal is None]

    @property
    def refusals(self) -> list[str]:
        """Why the engines that answer are refused (consistency.py); /health says it."""
        return [c.refusal for c in self.engines.values()
                if c.refusal is not None and c.alive(self.heartbeat_timeout_s)]

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

    # ---------------------------------------------------------------- requests

    def ranked_engines(self) -> list[EngineConnection]:
        """The engines in --engine-address order (a DNS name's in resolution order): the
        ranks scheduling_params.attention_dp_rank names."""
        return [c for c in self.engines.values() if not c.retired]

    def _place(self, request: EngineRequest, live: list[EngineConnection],
               routing: RoutingHints | None = None) -> EngineConnection:
        live = engines_with(live, request.lora_name)
        names: dict[str, EngineConnection] = {}
        for conn in live:
            name = conn.engine_id
            if name in names:  # two engines calling themselves the same: keep both apart
                name = f"{name}|{conn.address}"
            names[name] = conn
        page_size = next((getattr(c.stats, "page_size", 0) for c in live
                          if c.stats is not None and getattr(c.stats, "page_size", 0)), 16)
        cached = self._cached_runs(request, live, page_size)
        candidates = [Candidate(name=name, load=c.load(), kv_use=c.kv_use(),
                                waiting=c.stats.num_waiting if c.stats is not None else 0,
                                cached_pages=cached.get(c.address, 0))
                      for name, c in names.items()]
        routing = routing or RoutingHints()
        if routing.engine_rank is not None:
            ranked = self.ranked_engines()
            target = ranked[routing.engine_rank] if routing.engine_rank < len(ranked) else None
            name = next((n for n, c in names.items() if c is target), None)
            try:
                chosen = self.placement.choose_pinned(name, routing.relax, candidates)
            except PinnedUnavailable as exc:
                raise EngineUnavailable(str(exc)) from None
            if chosen is not None:
                return names[chosen]
        key = (conversation_key(routing.affinity, request.cache_salt) if routing.affinity
               else prefix_key(request.prompt_token_ids, request.cache_salt, page_size))
        return names[self.placement.choose(key, candidates)]

    def _cached_runs(self, request: EngineRequest, live: list[EngineConnection],
                     page_size: int) -> dict[str, int]:
        """--routing kv: the prompt's leading pages each engine holds, by address. A LoRA
        adapter's or an image's pages hash on what only the engine knows (the adapter's id
        there, the image's digest): those requests are placed as `prefix`."""
        if (self.kv_events is None or self.kv_events.index is None or len(live) < 2
                or request.lora_name or request.images
                or request.pooling is not None):
            return {}
        ids = np.frombuffer(request.prompt_token_ids, dtype="<i4")
        return self.kv_events.index.longest_runs(
            prompt_page_hashes(ids, page_size, request.cache_salt), [c.address for c in live])

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

    async def submit(self, request: EngineRequest, prompt_ids, queue: asyncio.Queue,
                     routing: RoutingHints | None = None) -> None:
        """Send a request; its TextFrames will arrive on `queue` (which several may share).
        With no live engine but one live within --engine-timeout (frozen, restarting,
        draining away), it waits for one that long."""
        live = await self._wait_for_live()
        if not live:
            raise EngineUnavailable("no engine is connected")
        meter = current_meter.get()
        if meter is not None and (request.priority or 0) < meter.priority_floor:
            # A keys-file key's priority is the best its requests get (lower runs first).
            request = msgspec.structs.replace(request, priority=meter.priority_floor)
        stream = RequestStream(queue, request, prompt_ids)
        target = self._place(request, live, routing)  # first: a refused pin leaves no trace
        self._streams[request.request_id] = stream
        self.tracker.submitted(request)
        await self._send_to(target, request.request_id, stream, request)

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
    # ---------------------------------------------------------------- limits

    def active_request_ids(self) -> list[str]:
        return list(self._streams)

    def requests_in_flight(self) -> list[tuple[str, RequestStream]]:
        """(request id, stream) of every request running (GET /v1/engines)."""
        return list(self._streams.items())

    async def fail_request(self, request_id: str, message: str, status: int) -> None:
        """End one running request with an error frame (its response says why) and abort it
        in the engine: used by --request-timeout and at the end of a drain."""
        stream = self._streams.get(request_id)
        if stream is None:
            return  # finished meanwhile
        self._deliver_error(request_id, stream, message, status)
        await self.abort(request_id)
