"""The engine's KV-event publisher (`--kv-events-config`), vLLM's ZeroMQ PUB and replay ROUTER.

The step loop hands each step's events over (`publish`): it numbers the batch and puts it
on a bounded queue, never waiting. A full queue drops the batch and counts it; its number is
spent all the same, so every subscriber sees the gap and knows its picture of this engine is
incomplete (the replay cannot fill it either). The publisher thread encodes, sends
[topic, number, payload] on the PUB socket (which itself drops past `hwm` for a slow
subscriber), keeps the last `buffer_steps` payloads, and answers replay requests from them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from shared.kv_events import END_SEQ, KVEventBatch, KvEventsConfig, binds, offset_endpoint

log = logging.getLogger("sluice.engine")


class KvEventPublisher:
    def __init__(self, ctx: zmq.Context, config: KvEventsConfig, rank: int = 0) -> None:
        self.rank = rank
        self.endpoint = offset_endpoint(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, rank)
        self.dropped = 0  # batches the full queue turned away
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._stopping = threading.Event()
        # Bound (or connected) here, so a port in use fails the start, naming it.
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if binds(self.endpoint) else self._pub.connect)(self.endpoint)
        self._replay = None
        if self.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="engine-kv-events", daemon=True)
        self._thread.start()
        log.info("KV-cache events on %s (replay: %s, data-parallel rank %d)", self.endpoint,
                 self.replay_endpoint or "none", rank)

    @property
    def announced_endpoint(self) -> str:
        """What the engine's stats tell frontends to subscribe to: a bound endpoint only (a
        connected one points at someone else's subscriber)."""
        return self.endpoint if binds(self.endpoint) else ""

    def publish(self, events: list) -> None:
        """One step's events; called by the step loop, never blocks."""
        if not events:
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV-event queue full (max_queue_size): %d batches dropped so far",
                            self.dropped)

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while not self._stopping.is_set():
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                seq, batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            payload = encoder.encode(batch)
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        """[id, "", start] from a REQ (vLLM's subscriber) or [id, start] from a DEALER:
        every buffered batch numbered start or later, then the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) not in (2, 3) or (len(frames) == 3 and frames[1]):
            log.warning("dropping a replay request of %d frames", len(frames))
            return
        head = frames[:-1]
        start = frames[-1]
        if len(start) == 8:
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([*head, END_SEQ, b""])
