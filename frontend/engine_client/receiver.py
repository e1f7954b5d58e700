"""The outputs, a part of `EngineClient` (`frontend.engine_client.client`).

Outputs arrive on this frontend's own PULL socket (`reply_to`), read by a receiver thread:
text frames from postproc workers, or token batches that it post-processes itself (when
there is no fleet, or every worker died), so the event loop only gets finished frames, one
hop per batch.
"""

from __future__ import annotations

import asyncio
import threading

import msgspec
import zmq

from frontend.engine_client.connection import RequestStream
from shared.codec import encode, frontend_inbound_decoder
from shared.protocol import AbortRequest, FrameBatch, OutputBatch, TextFrame
from shared.transport import make_socket


class OutputReceiver:
    """`EngineClient`'s receiver thread and the delivery of its frames on the event loop."""

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
