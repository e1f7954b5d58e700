"""The engine process: loads the model, then runs the busy loop with socket I/O on threads.

Threads: one receives requests, aborts and pings (and answers pings itself, so heartbeats
flow even during a long step; a frontend connection that stops sending for
--frontend-timeout has its requests aborted); one encodes and routes outputs to postproc workers or
frontends (`engine.process.output_router`). The main thread only drains
the inbox, steps the model and hands outputs over, so compute overlaps with (de)serialization.

SIGTERM drains: the engine tells every frontend at once (its stats say `draining`, so they
send it nothing new), runs what it holds for up to --shutdown-timeout, then exits; the
frontends move whatever it still ran to other engines as continuations. A second SIGTERM,
or SIGINT, stops it at once.
"""

from __future__ import annotations

import gc
import logging
import queue
import signal
import sys
import threading
import time

import msgspec
import zmq

from engine.process.build import build_engine
from engine.process.energy import EnergyMeters
from engine.process.kv_events import KvEventPublisher
from engine.process.metrics_server import start_metrics_server
from engine.process.output_router import FleetCounts, OutputRouter
from engine.process.profiler import EngineProfiler, ProfileError
from engine.step.core import EngineCore
from engine.step.kv_cache import KvEventLog
from shared.codec import encode, engine_inbound_decoder
from shared.config import EngineConfig
from shared.protocol import (
    AbortRequest,
    EngineCommand,
    EngineCommandResult,
    EngineRequest,
    EngineStats,
    LoraUpdate,
    Ping,
)
from shared.transport import make_socket

log = logging.getLogger("sluice.engine")


class Submitted(msgspec.Struct):
    """A request with the ROUTER identity of the connection it came on."""

    request: EngineRequest
    peer: bytes


class LoraOp(msgspec.Struct):
    """A run-time adapter load/unload with the connection to answer on."""

    update: LoraUpdate
    peer: bytes


class CommandOp(msgspec.Struct):
    """A profile command with the connection to answer on: run on the main thread, the one
    whose steps the profiler must see."""

    command: EngineCommand
    peer: bytes


class PeerGone(msgspec.Struct):
    """A frontend connection that stopped heartbeating: its requests are for nobody."""

    peer: bytes


class CloseResultSockets(msgspec.Struct):
    """For the send thread: stop pushing to these frontends (after their last outputs)."""

    addresses: list[str]


class PeerWatch:
    """Which connections heartbeat, and which went silent (the receive thread's).

    Only a connection that has sent a Ping is watched: one that never pings (a bare test
    client) cannot be told from a dead one. Any message counts as a sign of life. If this
    thread itself did not run for a while (the engine was stopped or starved), nobody is
    blamed for the gap: every clock restarts."""

    STALL_S = 1.0  # the receive thread ticks every 0.1 s; a longer gap is our own stall

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_heard: dict[bytes, float] = {}
        self._last_tick = time.monotonic()

    def heard(self, peer: bytes, is_ping: bool) -> None:
        if is_ping or peer in self._last_heard:
            self._last_heard[peer] = time.monotonic()

    def watched(self) -> list[bytes]:
        return list(self._last_heard)

    def silent(self) -> list[bytes]:
        """Connections silent past the timeout, forgotten as they are returned."""
        now = time.monotonic()
        gap, self._last_tick = now - self._last_tick, now
        if gap > self.STALL_S:
            for peer in self._last_heard:
                self._last_heard[peer] += gap
        if self.timeout_s <= 0:
            return []
        gone = [p for p, t in self._last_heard.items() if now - t > self.timeout_s]
        for peer in gone:
            del self._last_heard[peer]
        return gone


class EngineServer:
    def __init__(
        self, core: EngineCore, request_address: str, postproc_address: str | None = None,
        frontend_timeout_s: float = 10.0, kv_events: KvEventPublisher | None = None,
        profiler: EngineProfiler | None = None,
    ) -> None:
        self.core = core
        # --kv-events-config: each step's prefix-cache changes go out on it.
        self.kv_events = kv_events
        if kv_events is not None:
            core.allocator.events = KvEventLog()
            core.allocator.events.cleared()  # subscribers learn this engine starts empty
        self.profiler = profiler or EngineProfiler(None, core.engine_id)
        self.energy = EnergyMeters()
        self.request_address = request_address
        self.postproc_address = postproc_address
        self.ctx = zmq.Context()
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        # (peer, LoraUpdateResult): answers the receive thread sends (it owns the socket).
        self.replies: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.draining = threading.Event()
        self.drain_deadline = 0.0  # time.monotonic() when a drain gives up on what is left
        self.latest_stats = core.stats()
        self.fleet_counts = FleetCounts()
        self.peers = PeerWatch(frontend_timeout_s)

    def run(self) -> None:
        bound = threading.Event()
        threads = [
            threading.Thread(target=self._receive_loop, args=(bound,), name="engine-recv",
                             daemon=True),
            threading.Thread(target=self._send_loop, name="engine-send", daemon=True),
        ]
        for t in threads:
            t.start()
        bound.wait()
        log.info("engine listening on %s (id %s)", self.request_address, self.core.engine_id)
        try:
            self._busy_loop()
        finally:
            self.stopping.set()
            self.outbox.put(None)
            for t in threads:
                t.join(timeout=2)
            if self.kv_events is not None:
                self.kv_events.close()
            self.ctx.term()

    def drain(self, timeout_s: float) -> None:
        """Take nothing new (the frontends hear it now), finish within `timeout_s`."""
        self.drain_deadline = time.monotonic() + timeout_s
        self.draining.set()

    def _drained(self) -> bool:
        if not self.draining.is_set():
            return False
        if not self.core.has_work:
            log.info("drained: every request finished")
            return True
        if time.monotonic() >= self.drain_deadline:
            log.warning("--shutdown-timeout passed with %d requests still running: exiting; "
                        "their frontends move them to other engines",
                        len(self.core.sequences))
            return True
        return False

    def _busy_loop(self) -> None:
        core = self.core
        while not self.stopping.is_set() and not self._drained():
            abandoned = self._drain_inbox(block=not core.has_work)
            if core.has_work:
                started = time.perf_counter()
                outputs = core.step()
                if outputs:
                    self.outbox.put((outputs, time.perf_counter() - started))
            if self.kv_events is not None:
                self.kv_events.publish(core.allocator.events.take())
            if abandoned:
                # After the abort outputs above, so whoever still listens gets them.
                self.outbox.put(CloseResultSockets(abandoned))
            self.latest_stats = core.stats()

    def _drain_inbox(self, block: bool) -> list[str]:
        """Hands every message to the core; returns the result addresses that no request
        uses any more because their frontend went silent."""
        abandoned: list[str] = []
        try:
            message = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return abandoned
        while True:
            if isinstance(message, Submitted):
                self.core.add(message.request, peer=message.peer)
            elif isinstance(message, EngineRequest):
                self.core.add(message)
            elif isinstance(message, AbortRequest):
                self.core.abort(message.request_ids)
            elif isinstance(message, PeerGone):
                abandoned.extend(self.core.abort_peer(message.peer))
            elif isinstance(message, LoraOp):
                result = self.core.update_lora(message.update)
                self.latest_stats = self.core.stats()  # the next ping lists it already
                self.replies.put((message.peer, result))
            elif isinstance(message, CommandOp):
                self.replies.put((message.peer, self._step_command(message.command)))
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return abandoned

    def _receive_loop(self, bound: threading.Event) -> None:
        sock = make_socket(self.ctx, zmq.ROUTER)
        sock.bind(self.request_address)
        bound.set()
        decoder = engine_inbound_decoder()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        announced = False
        while not self.stopping.is_set():
            if self.draining.is_set() and not announced:
                # Every frontend learns now, not at its next ping, to send nothing new.
                announced = True
                for peer in self.peers.watched():
                    sock.send_multipart([peer, encode(self._stats())])
            for peer in self.peers.silent():
                self.inbox.put(PeerGone(peer))
            while not self.replies.empty():
                peer, result = self.replies.get_nowait()
                sock.send_multipart([peer, encode(result)])
            if not poller.poll(100):
                continue
            identity, payload = sock.recv_multipart(copy=False)
            try:
                message = decoder.decode(payload.buffer)
            except Exception as exc:  # a bad peer must not take the engine down
                log.warning("dropping undecodable message: %s", exc)
                continue
            self.peers.heard(identity.bytes, isinstance(message, Ping))
            if isinstance(message, Ping):
                sock.send_multipart([identity, encode(self._stats())])
                continue
            if isinstance(message, EngineRequest):
                # The router learns of it before its first output; postproc needs no pixels.
                self.outbox.put(msgspec.structs.replace(message, images=[]) if message.images
                                else message)
                message = Submitted(message, identity.bytes)
            elif isinstance(message, LoraUpdate):
                message = LoraOp(message, identity.bytes)
            elif isinstance(message, EngineCommand):
                if message.command == "read_energy":  # no step involved: answered here
                    sock.send_multipart([identity, encode(self._read_energy(message))])
                    continue
                message = CommandOp(message, identity.bytes)
            self.inbox.put(message)
        sock.close(linger=0)

    def _step_command(self, command: EngineCommand) -> EngineCommandResult:
        """A command run between steps, where the step loop's state may be touched."""
        if command.command == "reset_prefix_cache":
            owned = self.core.allocator.reset_prefix_cache()
            if owned:
                return EngineCommandResult(command.op_id, 409, f"{owned} KV pages are in use "
                                           "by running requests; retry when the engine idles")
            self.latest_stats = self.core.stats()
            return EngineCommandResult(command.op_id, 200)
        try:
            if command.command == "start_profile":
                self.profiler.start()
                return EngineCommandResult(command.op_id, 200)
            if command.command == "stop_profile":
                return EngineCommandResult(command.op_id, 200, path=self.profiler.stop())
        except ProfileError as exc:
            return EngineCommandResult(command.op_id, exc.status, str(exc))
        return EngineCommandResult(command.op_id, 400,
                                   f"unknown engine command {command.command[:100]!r}")

    def _read_energy(self, command: EngineCommand) -> EngineCommandResult:
        readings = self.energy.read()
        if not readings:
            return EngineCommandResult(command.op_id, 404, "this machine reports no energy "
                                       "counter (no readable RAPL zone, no NVML GPU)")
        return EngineCommandResult(command.op_id, 200, energy=readings)

    def _stats(self) -> EngineStats:
        fleet = self.fleet_counts
        return msgspec.structs.replace(
            self.latest_stats, num_postproc_workers=fleet.live_workers,
            postproc_assigned=fleet.assigned, postproc_replayed=fleet.replayed,
            draining=self.draining.is_set(), **self._kv_events_stats(),
        )

    def _kv_events_stats(self) -> dict:
        """Where frontends under --routing kv subscribe to this engine's KV events."""
        if self.kv_events is None:
            return {}
        return {"kv_events_endpoint": self.kv_events.announced_endpoint,
                "kv_events_replay_endpoint": self.kv_events.replay_endpoint or "",
                "kv_events_dropped": self.kv_events.dropped}

    def _send_loop(self) -> None:
        """Routes outputs to postproc workers or frontends; between batches it takes the
        workers' heartbeats, so a short wait keeps them flowing when the engine is idle."""
        router = OutputRouter(self.ctx, self.postproc_address)
        self.fleet_counts = router.counts
        try:
            while True:
                try:
                    item = self.outbox.get(timeout=0.05)
                except queue.Empty:
                    item = ()
                if item is None:
                    break
                if isinstance(item, EngineRequest):
                    router.add_request(item)
                elif isinstance(item, CloseResultSockets):
                    router.close_frontends(item.addresses)
                elif item:
                    router.route(*item)
                for abort in router.poll_workers():
                    self.inbox.put(abort)  # a worker matched a stop string
        finally:
            router.close()


def _start_kv_events(config: EngineConfig) -> KvEventPublisher | None:
    """--kv-events-config's sockets, bound before the model loads: a port in use fails
    the start at once, naming it."""
    if config.kv_events is None or not config.kv_events.publishes:
        return None
    try:
        return KvEventPublisher(zmq.Context.instance(), config.kv_events,
                                config.data_parallel_rank)
    except zmq.ZMQError as exc:
        raise SystemExit(f"sluice engine: --kv-events-config: cannot open "
                         f"{config.kv_events.endpoint} (offset by data-parallel rank "
                         f"{config.data_parallel_rank}) or its replay endpoint: {exc}") from None


def run_engine(config: EngineConfig) -> None:
    from engine.parallel.rendezvous import plan_rendezvous

    rdv = plan_rendezvous(config.tensor_parallel_size, config.nnodes, config.node_rank,
                          config.master_addr, config.master_port)
    if rdv is not None and rdv.rank != 0:  # a tensor-parallel rank of an engine elsewhere
        from engine.process.tp_worker import run_rank

        sys.exit(run_rank(config, rdv))
    if rdv is not None:  # the port picked now is the one every rank is told
        config = msgspec.structs.replace(config, master_port=rdv.master_port)
    built: list[EngineServer] = []  # the server, once the model is loaded
    if config.metrics_port is not None:
        # Bound before the model loads: tensor-parallel ranks open many ephemeral ports as
        # they meet, one of which could otherwise take a port picked as free beforehand.
        # Until the engine is built a scrape finds no series.
        start_metrics_server(config.metrics_host, config.metrics_port,
                             lambda: built[0]._stats() if built else None)
    kv_events = _start_kv_events(config)
    profiler = EngineProfiler(config.profile_dir, config.engine_id)  # a bad dir: before the load
    core = build_engine(config)
    # Everything loaded so far (torch, transformers, the tokenizer: ~400k objects) lives as
    # long as the process; frozen, the cyclic GC stops re-walking it in the middle of steps.
    gc.collect()
    gc.freeze()
    server = EngineServer(core, config.request_address, config.postproc_address,
                          config.frontend_timeout_s, kv_events, profiler)
    built.append(server)

    def stop(signum, frame):
        server.stopping.set()

    def drain(signum, frame):
        if server.draining.is_set():
            server.stopping.set()  # a second SIGTERM: now
            return
        log.info("SIGTERM: draining (up to %gs), taking no new requests",
                 config.shutdown_timeout_s)
        server.drain(config.shutdown_timeout_s)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, stop)
    try:
        server.run()
    except Exception:
        # A failed step leaves the cache and scheduler untrustworthy: exit non-zero so an
        # orchestrator restarts the engine (frontends answer 503 meanwhile).
        log.exception("engine fault; exiting")
        sys.exit(1)
    close = getattr(core.runner.model, "close", None)  # tensor-parallel ranks, if any
    if close is not None:
        close()
