"""The frontend's side of the engine connection.

Requests and aborts go out on a DEALER connected to the engine's ROUTER; pings ride the same
socket and the engine's stats come back on it, which doubles as the heartbeat. Outputs arrive
on this frontend's own PULL socket (`reply_to`), read by a receiver thread: text frames from
postproc workers, or token batches that it post-processes itself (when there is no fleet, or
every worker died), so the event loop only gets finished frames, one hop per batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import msgspec
import zmq
import zmq.asyncio

from frontend.tracking import RequestTracker
from postproc.processor import OutputProcessor
from shared.codec import encode, frontend_inbound_decoder
from shared.protocol import (
    AbortRequest,
    EngineRequest,
    EngineStats,
    FrameBatch,
    OutputBatch,
    Ping,
    TextFrame,
)
from shared.transport import make_socket, new_ipc_address

log = logging.getLogger("sluice.frontend")


class EngineUnavailable(Exception):
    pass


class RequestStream(msgspec.Struct):
    queue: asyncio.Queue
    next_seq: int = 0
    finished: bool = False


class EngineClient:
    def __init__(
        self,
        engine_address: str,
        processor: OutputProcessor,
        result_address: str | None = None,
        heartbeat_interval_s: float = 1.0,
        engine_timeout_s: float = 5.0,
    ) -> None:
        self.engine_address = engine_address
        self.result_address = result_address or new_ipc_address("frontend")
        self.processor = processor
        self.heartbeat_interval_s = heartbeat_interval_s
        self.engine_timeout_s = engine_timeout_s
        self.frontend_id = f"frontend-{uuid.uuid4().hex[:8]}"
        self.stats: EngineStats | None = None
        self._last_heard = 0.0
        self._streams: dict[str, RequestStream] = {}
        # Requests failed because the engine went silent: if it comes back (it was frozen,
        # not dead) it must drop them, so their aborts go out once it answers again.
        self._orphans: set[str] = set()
        self._ctx = zmq.asyncio.Context()
        self._stopping = threading.Event()
        self._tasks: list[asyncio.Task] = []
        self._sends: set[asyncio.Future] = set()
        self.tracker = RequestTracker(self)  # request metrics and timeouts
        self._stats_arrived = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._connect()
        bound = threading.Event()
        self._receiver = threading.Thread(
            target=self._receive_outputs, args=(bound,), name="frontend-recv", daemon=True
        )
        self._receiver.start()
        bound.wait()
        self._stats_task = asyncio.create_task(self._stats_loop())
        self._tasks = [asyncio.create_task(self._ping_loop())]

    def _connect(self) -> None:
        self._dealer = make_socket(self._ctx, zmq.DEALER)
        self._dealer.connect(self.engine_address)

    def _reconnect(self) -> None:
        """A fresh connection after the engine was lost: what the old one still queued
        (requests whose streams already failed) must not reach a restarted engine, which
        would generate them for nobody."""
        self._stats_task.cancel()
        self._dealer.close(linger=0)
        self._connect()
        self._stats_task = asyncio.create_task(self._stats_loop())

    async def stop(self) -> None:
        self._stopping.set()
        for task in [*self._tasks, self._stats_task]:
            task.cancel()
        self._receiver.join(timeout=2)
        self._dealer.close(linger=0)
        self._ctx.term()

    # ---------------------------------------------------------------- health

    @property
    def engine_alive(self) -> bool:
        return time.monotonic() - self._last_heard < self.engine_timeout_s

    async def _ping_loop(self) -> None:
        was_alive = False
        while True:
            ping = Ping(sender_id=self.frontend_id, sent_at=time.time())
            await self._dealer.send(encode(ping))
            await asyncio.sleep(self.heartbeat_interval_s)
            alive = self.engine_alive
            if was_alive and not alive:
                log.error("engine stopped answering; failing %d requests", len(self._streams))
                self._fail_all("the engine stopped responding")
                self._reconnect()
            was_alive = alive

    async def _stats_loop(self) -> None:
        decoder = frontend_inbound_decoder()
        while True:
            message = decoder.decode(await self._dealer.recv())
            if isinstance(message, EngineStats):
                self.stats = message
                self._last_heard = time.monotonic()
                if self._orphans:
                    orphans, self._orphans = sorted(self._orphans), set()
                    log.info("the engine answers again; aborting the %d requests failed "
                             "while it was silent", len(orphans))
                    await self._dealer.send(encode(AbortRequest(orphans)))
                self._stats_arrived.set()
                self._stats_arrived = asyncio.Event()

    async def refresh_stats(self, timeout_s: float = 1.0) -> None:
        """Ask the engine for its stats now, so a scrape never shows a second-old picture."""
        arrived = self._stats_arrived
        await self._dealer.send(encode(Ping(sender_id=self.frontend_id, sent_at=time.time())))
        try:
            await asyncio.wait_for(arrived.wait(), timeout_s)
        except TimeoutError:
            pass  # the engine is busy or gone: the heartbeat's picture has to do

    # ---------------------------------------------------------------- requests

    async def submit(self, request: EngineRequest, prompt_ids, queue: asyncio.Queue) -> None:
        """Send a request; its TextFrames will arrive on `queue` (which several may share)."""
        if not self.engine_alive:
            raise EngineUnavailable("no engine is connected")
        stream = RequestStream(queue)
        self._streams[request.request_id] = stream
        self.processor.register(request.request_id, prompt_ids, request.output)
        self.tracker.submitted(request)
        await self._dealer.send(encode(request))

    async def abort(self, request_id: str) -> None:
        """Stop a request early; safe to call for finished or unknown ids."""
        stream = self._streams.pop(request_id, None)
        self.processor.discard(request_id)
        self.tracker.ended(request_id, "abort")
        if stream is not None and not stream.finished:
            await self._dealer.send(encode(AbortRequest([request_id])))

    def in_flight(self, request_id: str) -> bool:
        """Whether this frontend already has a request with this id running."""
        return request_id in self._streams

    def release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
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

    def _deliver(self, frames: list[TextFrame], stopped_early: list[str]) -> None:
        if stopped_early:
            # A stop string ended these; the engine is still generating them.
            send = asyncio.ensure_future(self._dealer.send(encode(AbortRequest(stopped_early))))
            self._sends.add(send)  # keep a reference until it is done
            send.add_done_callback(self._sends.discard)
        for frame in frames:
            stream = self._streams.get(frame.request_id)
            if stream is None or frame.seq < stream.next_seq:
                continue  # gone, or a duplicate from a replaying postproc worker
            stream.next_seq = frame.seq + 1
            if frame.finish_reason is not None:
                stream.finished = True
                del self._streams[frame.request_id]
                # A postproc worker did the work; drop the spec kept in case it died.
                self.processor.discard(frame.request_id)
            self.tracker.delivered(frame)
            stream.queue.put_nowait(frame)

    def _fail_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        self._orphans.update(streams)
        for request_id, stream in streams.items():
            self.processor.discard(request_id)
            frame = TextFrame(
                request_id=request_id, seq=stream.next_seq, text="", token_ids=b"",
                num_prompt_tokens=0, num_output_tokens=0, finish_reason="error",
                error=message, error_status=503,
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
        frame = TextFrame(
            request_id=request_id, seq=stream.next_seq, text="", token_ids=b"",
            num_prompt_tokens=0, num_output_tokens=0, finish_reason="error",
            error=message, error_status=status,
        )
        self.tracker.delivered(frame)
        stream.queue.put_nowait(frame)
        await self.abort(request_id)
