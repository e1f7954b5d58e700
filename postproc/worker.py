"""A postproc worker process: registers with the engine, takes the token batches of the
requests the engine assigns it, and pushes finished text frames (with chunk bytes for
streamed requests) straight to each request's frontend (req S-1, S-4).

It holds per-request parser state only. When it dies, the engine replays its requests on
another worker; when it comes back after the engine gave it up, the engine tells it to reset.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import defaultdict

import zmq

from postproc.processor import OutputProcessor
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
from shared.transport import PushPool, make_socket

log = logging.getLogger("sluice.postproc")


class PostprocWorker:
    def __init__(
        self, tokenizer, engine_address: str, heartbeat_interval_s: float = 0.25
    ) -> None:
        self.engine_address = engine_address
        self.worker_id = f"postproc-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.processor = OutputProcessor(tokenizer)
        self.stopping = threading.Event()
        self._reply_to: dict[str, str] = {}

    def run(self) -> None:
        ctx = zmq.Context()
        engine = make_socket(ctx, zmq.DEALER)
        engine.connect(self.engine_address)
        frontends = PushPool(ctx)
        decoder = worker_inbound_decoder()
        log.info("postproc worker %s connecting to %s", self.worker_id, self.engine_address)
        next_beat = 0.0
        try:
            while not self.stopping.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    engine.send(encode(WorkerHeartbeat(self.worker_id, time.time())))
                    next_beat = now + self.heartbeat_interval_s
                wait_ms = max(1, int((next_beat - time.monotonic()) * 1000))
                if not engine.poll(wait_ms):
                    continue
                batch = decoder.decode(engine.recv(copy=False).buffer)
                self._handle(batch, engine, frontends)
        finally:
            frontends.close()
            engine.close(linger=0)
            ctx.term()

    def _handle(self, batch: WorkBatch, engine: zmq.Socket, frontends: PushPool) -> None:
        if batch.reset:
            self.processor.clear()
            self._reply_to.clear()
        for request in batch.assignments:
            prompt = unpack_ids(request.prompt_token_ids)
            self.processor.register(request.request_id, prompt, request.output)
            self._reply_to[request.request_id] = request.reply_to
        processed = self.processor.process(batch.outputs)
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
            engine.send(encode(WorkerDone(done)))


def run_postproc(model: str, engine_address: str) -> None:
    import signal

    from shared.tokenizer import load_tokenizer

    worker = PostprocWorker(load_tokenizer(model), engine_address)

    def stop(signum, frame):
        worker.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run()
