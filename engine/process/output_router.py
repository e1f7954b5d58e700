"""Where each request's outputs go: to the postproc worker it is assigned to, or straight to
its frontend when no worker is live (DESIGN: postproc).

Owned by the engine's send thread, which also owns the workers' ROUTER socket (zmq sockets are
not thread-safe). A request is assigned when its first output appears, to the live worker
with the fewest requests, and keeps that worker for its life. While assigned, its outputs are
kept: when the worker dies (a send to it fails, or it misses heartbeats) they are replayed, in
order, on another worker, or sent to the frontend, which post-processes them itself. A
request's frames are a pure function of its outputs, so the replay reproduces the frames the
dead worker sent, and the frontend drops the ones it has (sequence numbers).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import msgspec
import zmq

from shared.codec import encode, engine_from_worker_decoder
from shared.protocol import (
    AbortRequest,
    EngineRequest,
    OutputBatch,
    RequestOutput,
    WorkBatch,
    WorkerDone,
    WorkerHeartbeat,
)
from shared.transport import PushPool, make_socket

log = logging.getLogger("sluice.engine")


class Worker(msgspec.Struct):
    routing_id: bytes
    worker_id: str
    last_heard: float
    requests: set[str] = msgspec.field(default_factory=set)


class Route(msgspec.Struct):
    request: EngineRequest
    worker: bytes | None = None  # routing id; None = the frontend post-processes it
    assigned: bool = False  # decided at the first output, then fixed
    history: list[RequestOutput] = msgspec.field(default_factory=list)


class Outgoing(msgspec.Struct):
    assignments: list[EngineRequest] = msgspec.field(default_factory=list)
    outputs: list[RequestOutput] = msgspec.field(default_factory=list)


class FleetCounts(msgspec.Struct):
    """Read by the engine's receive thread for its stats (plain ints: no lock needed)."""

    live_workers: int = 0
    assigned: int = 0
    replayed: int = 0


class OutputRouter:
    def __init__(
        self, ctx: zmq.Context, postproc_address: str | None, worker_timeout_s: float = 3.0
    ) -> None:
        self._frontends = PushPool(ctx)
        self._workers: dict[bytes, Worker] = {}
        self._routes: dict[str, Route] = {}
        self._timeout = worker_timeout_s
        self._decoder = engine_from_worker_decoder()
        self.counts = FleetCounts()
        self._socket = None
        if postproc_address is not None:
            self._socket = make_socket(ctx, zmq.ROUTER)
            # A send to a worker that has gone away raises instead of vanishing: the fastest
            # sign of a dead worker.
            self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._socket.bind(postproc_address)

    # ---------------------------------------------------------------- requests and outputs

    def add_request(self, request: EngineRequest) -> None:
        if self._socket is None:
            return  # no fleet: everything goes to frontends, nothing to remember
        # A duplicate id is rejected by the engine; keep the running request's route.
        self._routes.setdefault(request.request_id, Route(request))

    def route(self, outputs: list[tuple[str, RequestOutput]], step_time: float) -> None:
        to_frontends: dict[str, list[RequestOutput]] = defaultdict(list)
        to_workers: dict[bytes, Outgoing] = defaultdict(Outgoing)
        finished: list[Route] = []
        for reply_to, output in outputs:
            route = self._routes.get(output.request_id)
            if route is None or route.request.reply_to != reply_to:
                to_frontends[reply_to].append(output)
                continue
            if not route.assigned:
                self._assign(route, to_workers)
            if output.finish_reason is not None:
                finished.append(route)
            if route.worker is None:
                to_frontends[reply_to].append(output)
            else:
                route.history.append(output)
                to_workers[route.worker].outputs.append(output)
        for reply_to, batch in to_frontends.items():
            self._send_to_frontend(reply_to, OutputBatch(batch, step_time))
        self._send_work(to_workers, step_time)
        # A worker's requests are forgotten when it reports their last frame sent
        # (`WorkerDone`): should it die before, they replay elsewhere.
        for route in finished:
            if route.worker is None:
                self._forget(route)

    def _send_to_frontend(self, reply_to: str, batch: OutputBatch) -> None:
        try:
            self._frontends.send(reply_to, encode(batch))
        except zmq.ZMQError as exc:
            # An address zmq cannot connect to (the engine validates them, but a bad one
            # must cost its own outputs only, never this thread).
            log.warning("dropping outputs for %r: %s", reply_to[:200], exc)

    def _assign(self, route: Route, to_workers: dict[bytes, Outgoing]) -> None:
        route.assigned = True
        worker = self._least_loaded()
        if worker is None:
            return
        route.worker = worker.routing_id
        worker.requests.add(route.request.request_id)
        to_workers[worker.routing_id].assignments.append(route.request)
        self.counts.assigned += 1

    def _forget(self, route: Route) -> None:
        self._routes.pop(route.request.request_id, None)
        worker = self._workers.get(route.worker) if route.worker is not None else None
        if worker is not None:
            worker.requests.discard(route.request.request_id)

    def _least_loaded(self) -> Worker | None:
        return min(self._workers.values(), key=lambda w: len(w.requests), default=None)

    def _send_work(self, to_workers: dict[bytes, Outgoing], step_time: float) -> None:
        dead = []
        for routing_id, work in to_workers.items():
            batch = WorkBatch(work.assignments, work.outputs, step_time)
            if not self._send_to_worker(routing_id, batch):
                dead.append(routing_id)
        for routing_id in dead:
            self._bury(routing_id, "it went away")

    def _send_to_worker(self, routing_id: bytes, batch: WorkBatch) -> bool:
        try:
            self._socket.send_multipart([routing_id, encode(batch)])
            return True
        except zmq.ZMQError:  # EHOSTUNREACH: the worker's connection is gone
            return False

    # ---------------------------------------------------------------- workers

    def poll_workers(self) -> list[AbortRequest]:
        """Takes the workers' heartbeats and stop-string aborts (returned for the core) and
        buries workers that went silent."""
        aborts: list[AbortRequest] = []
        if self._socket is None:
            return aborts
        while True:
            try:
                routing_id, payload = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                message = self._decoder.decode(payload.buffer)
            except msgspec.DecodeError as exc:
                log.warning("dropping undecodable message from a postproc worker: %s", exc)
                continue
            if isinstance(message, WorkerHeartbeat):
                self._heard(routing_id.bytes, message.worker_id)
            elif isinstance(message, WorkerDone):
                self._done(routing_id.bytes, message.request_ids)
            else:
                aborts.append(message)
        now = time.monotonic()
        for worker in [w for w in self._workers.values() if now - w.last_heard > self._timeout]:
            self._bury(worker.routing_id, f"no heartbeat for {self._timeout:.1f}s")
        return aborts

    def _done(self, routing_id: bytes, request_ids: list[str]) -> None:
        for request_id in request_ids:
            route = self._routes.get(request_id)
            if route is not None and route.worker == routing_id:
                self._forget(route)

    def _heard(self, routing_id: bytes, worker_id: str) -> None:
        worker = self._workers.get(routing_id)
        if worker is not None:
            worker.last_heard = time.monotonic()
            return
        # New, or back after we gave it up: whatever it still holds was replayed elsewhere.
        if self._send_to_worker(routing_id, WorkBatch([], [], 0.0, reset=True)):
            self._workers[routing_id] = Worker(routing_id, worker_id, time.monotonic())
            self.counts.live_workers = len(self._workers)
            log.info("postproc worker %s joined (%d live)", worker_id, len(self._workers))

    def _bury(self, routing_id: bytes, why: str) -> None:
        """Moves a dead worker's requests, with their outputs so far, to the living."""
        worker = self._workers.pop(routing_id, None)
        if worker is None:
            return
        self.counts.live_workers = len(self._workers)
        log.warning("postproc worker %s is gone (%s); replaying its %d requests",
                    worker.worker_id, why, len(worker.requests))
        to_workers: dict[bytes, Outgoing] = defaultdict(Outgoing)
        to_frontends: dict[str, list[RequestOutput]] = defaultdict(list)
        for request_id in worker.requests:
            route = self._routes.get(request_id)
            if route is None:
                continue
            self.counts.replayed += 1
            heir = self._least_loaded()
            if heir is None:
                route.worker = None
                to_frontends[route.request.reply_to].extend(route.history)
                route.history = []
                continue
            route.worker = heir.routing_id
            heir.requests.add(request_id)
            to_workers[heir.routing_id].assignments.append(route.request)
            to_workers[heir.routing_id].outputs.extend(route.history)
        for reply_to, batch in to_frontends.items():
            self._send_to_frontend(reply_to, OutputBatch(batch, 0.0))
        self._send_work(to_workers, 0.0)

    def close_frontends(self, addresses: list[str]) -> None:
        """Closes the sockets to frontends that went silent, so outputs for them no longer
        queue up in memory. A short linger lets the abort outputs just routed go out."""
        for address in addresses:
            # PushPool has no per-address close; its dict is the one place sockets live.
            sock = self._frontends._sockets.pop(address, None)
            if sock is not None:
                sock.close(linger=1000)

    def close(self) -> None:
        self._frontends.close()
        if self._socket is not None:
            self._socket.close(linger=0)
