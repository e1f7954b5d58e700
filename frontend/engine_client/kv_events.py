"""The frontend's subscriptions to its engines' KV events (`--routing kv`), on a thread.

Each engine's stats name its events endpoint (and replay endpoint); `follow` subscribes to
it, `forget` drops it and what the index holds for that engine. The thread keeps every
feed's sequence numbers: batch n+1 after n is applied; a hole (a batch lost to a slow
subscriber, dropped by the engine, or sent before this frontend joined) is filled from the
engine's replay socket when it has one, and otherwise, or when the replay cannot fill it,
that engine's entries are dropped (a short picture, never a wrong one) and the feed goes on
from the new batch. A number that goes back is a restarted engine: its entries are dropped.
Anything malformed is dropped and counted; nothing a peer sends stops the thread.

Every frontend follows the engines that publish: each applied batch goes to the index (only
under `--routing kv`, where placement reads it) and to the journal TensorRT-LLM's
POST /kv_cache_events drains (`kv_journal.py`), a hole also marked there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import zmq

from frontend.engine_client.kv_index import KvIndex
from frontend.engine_client.kv_journal import KvJournal
from shared.kv_events import END_SEQ, KVEventBatch, connectable

log = logging.getLogger("sluice.frontend")

MAX_MESSAGE_BYTES = 64 << 20  # a larger message closes the connection (ZeroMQ's MAXMSGSIZE)
REPLAY_TIMEOUT_S = 2.0  # a replay that has not ended by then is given up
MAX_HELD = 10_000  # live batches kept while a replay runs; past it the replay is given up


class Feed:
    """One engine's subscription."""

    def __init__(self, ctx: zmq.Context, engine: str, endpoint: str, replay: str) -> None:
        self.engine = engine
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = None
        if replay:
            self.replay = ctx.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            try:
                self.replay.connect(replay)
            except zmq.ZMQError:
                self.close()
                raise
        self.last_seq = -1  # the last batch applied
        self.replay_deadline: float | None = None  # set: a replay runs
        self.held: list[tuple[int, KVEventBatch]] = []  # live batches during a replay

    def close(self) -> None:
        for sock in (self.sub, self.replay):
            if sock is not None:
                sock.close(linger=0)


class KvEventSubscriber:
    def __init__(self, index: KvIndex | None, journal: KvJournal | None = None) -> None:
        self.index = index  # None: not --routing kv, nothing places by it
        self.journal = journal
        self.batches = 0  # applied
        self.malformed = 0  # dropped undecodable or ill-formed messages
        self.gaps = 0  # holes no replay filled: that engine's entries were dropped
        self._followed: dict[str, tuple[str, str]] = {}  # the event loop's view
        self._commands: queue.Queue = queue.Queue()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._feeds: dict[str, Feed] = {}  # the thread's
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="frontend-kv-events",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2)

    def follow(self, engine: str, engine_address: str, endpoint: str, replay: str) -> None:
        """The engine's latest stats name these endpoints ("": none): subscribe, or move the
        subscription if they changed (an engine restarted with other ones)."""
        wanted = (connectable(endpoint, engine_address) if endpoint else "",
                  connectable(replay, engine_address) if replay else "")
        if self._followed.get(engine, ("", "")) == wanted:
            return
        self._followed[engine] = wanted
        self._commands.put(("follow", engine, wanted))

    def forget(self, engine: str) -> None:
        if self._followed.pop(engine, None) is not None:
            self._commands.put(("forget", engine, None))

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            while not self._stopping.is_set():
                self._take_commands(ctx)
                self._poll()
        finally:
            for feed in self._feeds.values():
                feed.close()
            ctx.term()

    def _take_commands(self, ctx: zmq.Context) -> None:
        while not self._commands.empty():
            verb, engine, endpoints = self._commands.get_nowait()
            old = self._feeds.pop(engine, None)
            if old is not None:
                old.close()
            self._drop(engine)
            if verb == "follow" and endpoints[0]:
                try:
                    feed = Feed(ctx, engine, *endpoints)
                except zmq.ZMQError as exc:  # its stats named something no socket takes
                    log.warning("KV events: engine %s names %s: %s; not following it",
                                engine, endpoints, exc)
                    self.malformed += 1
                    continue
                self._feeds[engine] = feed
                self._ask_replay(feed, 0)  # what it published before this frontend came

    def _poll(self) -> None:
        if not self._feeds:
            time.sleep(0.1)
            return
        poller = zmq.Poller()
        for feed in self._feeds.values():
            poller.register(feed.sub, zmq.POLLIN)
            if feed.replay is not None:
                poller.register(feed.replay, zmq.POLLIN)
        ready = dict(poller.poll(100))
        for feed in list(self._feeds.values()):
            if feed.replay is not None and feed.replay in ready:
                self._on_replay(feed)
            if feed.sub in ready:
                self._on_live(feed)
            if feed.replay_deadline is not None and time.monotonic() > feed.replay_deadline:
                log.warning("KV events: engine %s's replay did not end; going on without it",
                            feed.engine)
                self._end_replay(feed)

    def _decode(self, seq_bytes: bytes, payload: bytes) -> tuple[int, KVEventBatch] | None:
        if len(seq_bytes) != 8:
            self.malformed += 1
            return None
        try:
            return int.from_bytes(seq_bytes, "big"), self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.malformed += 1
            return None

    def _on_live(self, feed: Feed) -> None:
        for _ in range(100):  # a burst, not forever: the other feeds wait
            try:
                frames = feed.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                self.malformed += 1
                continue
            got = self._decode(frames[1], frames[2])
            if got is None:
                continue
            if feed.replay_deadline is not None:
                feed.held.append(got)
                if len(feed.held) > MAX_HELD:
                    self._end_replay(feed)
                continue
            self._take(feed, *got, may_replay=True)

    def _take(self, feed: Feed, seq: int, batch: KVEventBatch, may_replay: bool) -> None:
        if seq <= feed.last_seq:  # numbers went back: the engine restarted
            self._drop(feed.engine)
        elif seq > feed.last_seq + 1:
            if may_replay and feed.replay is not None:
                feed.held.append((seq, batch))
                self._ask_replay(feed, feed.last_seq + 1)
                return
            if feed.last_seq >= 0:
                log.warning("KV events: engine %s skipped batches %d..%d; dropping what it "
                            "was known to hold", feed.engine, feed.last_seq + 1, seq - 1)
            self.gaps += 1
            self._drop(feed.engine)
            if self.journal is not None:
                self.journal.gap(feed.engine)
        if self.index is not None:
            self.index.apply(feed.engine, batch)
        if self.journal is not None:
            self.journal.record(feed.engine, batch)
        feed.last_seq = seq
        self.batches += 1

    def _drop(self, engine: str) -> None:
        if self.index is not None:
            self.index.drop(engine)

    def _ask_replay(self, feed: Feed, start: int) -> None:
        if feed.replay is None:
            return
        feed.replay.send_multipart([b"", start.to_bytes(8, "big")])
        feed.replay_deadline = time.monotonic() + REPLAY_TIMEOUT_S

    def _on_replay(self, feed: Feed) -> None:
        for _ in range(1000):
            try:
                frames = feed.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[0]:
                self.malformed += 1
                continue
            if frames[1] == END_SEQ:
                self._end_replay(feed)
                continue
            got = self._decode(frames[1], frames[2])
            if got is not None and feed.replay_deadline is not None and got[0] > feed.last_seq:
                self._take(feed, *got, may_replay=False)

    def _end_replay(self, feed: Feed) -> None:
        """The live batches that came meanwhile, in order; a hole left now stays a hole."""
        feed.replay_deadline = None
        held, feed.held = sorted(feed.held, key=lambda item: item[0]), []
        for seq, batch in held:
            if seq > feed.last_seq:
                self._take(feed, seq, batch, may_replay=False)
