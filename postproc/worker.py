"""A postproc worker process: registers with every engine it is given, takes the token
batches of the requests each engine assigns it, and pushes finished text frames (with chunk
bytes for streamed requests) straight to each request's frontend (req S-1, S-4).

One DEALER per engine (`--engine-postproc-address` repeats; `dns+tcp://NAME:PORT` is every
address NAME resolves to, re-resolved every few seconds, as a frontend's engine addresses),
each with its own heartbeat, so every engine sees the worker as its own. A stop string is
reported to the engine that sent the request.

It holds per-request parser state only. When it dies, each engine replays its requests on
another worker; when it comes back after an engine gave it up, that engine tells it to reset,
which drops only that engine's requests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

import zmq

from postproc.processor import OutputProcessor
from postproc.tracing import postproc_traces
from shared.codec import encode, worker_inbound_decoder
from shared.protocol import (
    AbortRequest,
    FrameBatch,
    TextFrame,
    WorkBatch,
    WorkerDone,
    WorkerHeartbeat,
    unpack_ids,
)
from shared.transport import (
    PushPool,
    is_dns_address,
    make_socket,
    resolve_host,
    split_dns_address,
    tcp_address,
)

log = logging.getLogger("sluice.postproc")


class PostprocWorker:
    def __init__(
        self, tokenizer, engine_address: str | list[str], heartbeat_interval_s: float = 0.25,
        resolver: Callable[[str, int], list[str]] | None = None,
        resolve_interval_s: float = 5.0,
    ) -> None:
        self.engine_sources = ([engine_address] if isinstance(engine_address, str)
                               else list(engine_address))
        for source in self.engine_sources:
            if is_dns_address(source):
                split_dns_address(source)  # fails now, naming it, if malformed
        self.engine_address = " ".join(self.engine_sources)
        self.worker_id = f"postproc-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.resolver = resolver or resolve_host
        self.resolve_interval_s = resolve_interval_s
        self.processor = OutputProcessor(tokenizer)
        self.stopping = threading.Event()
        self._reply_to: dict[str, str] = {}
        self._owned: dict[str, set[str]] = defaultdict(set)  # engine address -> request ids
        self.engines: dict[str, zmq.Socket] = {}
        self.traces = postproc_traces(self.worker_id)  # None: this worker traces nothing

    def _wanted(self) -> set[str]:
        """The engine addresses the sources name now (a failed lookup keeps what it had)."""
        wanted: set[str] = set()
        for source in self.engine_sources:
            if not is_dns_address(source):
                wanted.add(source)
                continue
            host, port = split_dns_address(source)
            try:
                wanted.update(tcp_address(ip, port) for ip in self.resolver(host, port))
            except Exception as exc:  # noqa: BLE001 - DNS trouble must not stop the worker
                log.warning("resolving %s failed (%s); keeping its engines", source, exc)
                wanted.update(a for a in self.engines if a.endswith(f":{port}"))
        return wanted

    def _sync_engines(self, ctx: zmq.Context, poller: zmq.Poller) -> None:
        wanted = self._wanted()
        for address in sorted(wanted - set(self.engines)):
            sock = make_socket(ctx, zmq.DEALER)
            if address.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(address)
            poller.register(sock, zmq.POLLIN)
            self.engines[address] = sock
            log.info("postproc worker %s connecting to %s", self.worker_id, address)
        for address in sorted(set(self.engines) - wanted):
            sock = self.engines.pop(address)
            poller.unregister(sock)
            sock.close(linger=0)
            self._drop(address)  # that engine replays them elsewhere
            log.info("postproc worker %s leaves %s", self.worker_id, address)

    def _drop(self, address: str) -> None:
        for request_id in self._owned.pop(address, set()):
            self.processor.discard(request_id)
            self._reply_to.pop(request_id, None)
            if self.traces is not None:
                self.traces.forget(request_id)

    def run(self) -> None:
        ctx = zmq.Context()
        poller = zmq.Poller()
        frontends = PushPool(ctx)
        decoder = worker_inbound_decoder()
        next_beat = next_resolve = 0.0
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= next_resolve:
                    self._sync_engines(ctx, poller)
                    next_resolve = now + self.resolve_interval_s
                if now >= next_beat:
                    beat = encode(WorkerHeartbeat(self.worker_id, time.time()))
                    for sock in self.engines.values():
                        sock.send(beat)
                    next_beat = now + self.heartbeat_interval_s
                wait_ms = max(1, int((next_beat - time.monotonic()) * 1000))
                ready = dict(poller.poll(wait_ms))
                for address, sock in list(self.engines.items()):
                    if sock in ready:
                        batch = decoder.decode(sock.recv(copy=False).buffer)
                        self._handle(batch, sock, frontends, address)
        finally:
            frontends.close()
            for sock in self.engines.values():
                sock.close(linger=0)
            ctx.term()

    def _handle(self, batch: WorkBatch, engine: zmq.Socket, frontends: PushPool,
                address: str = "") -> None:
        if batch.reset:  # this engine gave us up: drop only its requests
            self._drop(address)
        owned = self._owned[address]
        for request in batch.assignments:
            prompt = unpack_ids(request.prompt_token_ids)
            timed = (self.traces is not None and request.trace_context is not None
                     and self.traces.assigned(request))
            self.processor.register(request.request_id, prompt, request.output,
                                    request.continuation, timed)
            self._reply_to[request.request_id] = request.reply_to
            owned.add(request.request_id)
        processed = self.processor.process(batch.outputs)
        if self.traces is not None:
            self.traces.finished(processed)
        by_frontend: dict[str, list[TextFrame]] = defaultdict(list)
        done = []
        for frame in processed.frames:
            by_frontend[self._reply_to[frame.request_id]].append(frame)
            if frame.finish_reason is not None:
                done.append(frame.request_id)
        for reply_to, frames in by_frontend.items():
            frontends.send(reply_to, encode(FrameBatch(frames)))
        if processed.stopped_early:
            engine.send(encode(AbortRequest(processed.stopped_early)))
        if done:
            for request_id in done:
                del self._reply_to[request_id]
                owned.discard(request_id)
            engine.send(encode(WorkerDone(done)))


def run_postproc(tokenizer: str, engine_address: str | list[str], tokenizer_mode: str = "auto",
                 model: str | None = None) -> None:
    import signal

    from shared.tokenizer import load_tokenizer

    worker = PostprocWorker(load_tokenizer(tokenizer, tokenizer_mode, model=model),
                            engine_address)

    def stop(signum, frame):
        worker.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
