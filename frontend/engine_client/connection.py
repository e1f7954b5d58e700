"""What the engine client keeps per engine (`EngineConnection`: its socket, its heartbeat,
the requests on it) and per request (`RequestStream`: where it runs and what the client
already has, which a move sends on as a `Continuation`)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq.asyncio

from shared.protocol import Continuation, EngineRequest, EngineStats


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
        # Why this frontend refuses it (another model or tokenizer; consistency.py); None:
        # it may take requests.
        self.refusal: str | None = None
        # This frontend's requests moved onto it / off it (GET /v1/engines).
        self.migrated_in = 0
        self.migrated_out = 0

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
    lost_from: EngineConnection | None = None  # the engine it lost, until it moves off it
    # What the client has: the tokens of the frames delivered, and how many each held.
    output_ids: bytearray = msgspec.field(default_factory=bytearray)
    frame_sizes: list[int] = msgspec.field(default_factory=list)
    cumulative_logprob: float = 0.0

    def continuation(self) -> Continuation | None:
        if not self.frame_sizes:
            return None
        return Continuation(bytes(self.output_ids), list(self.frame_sizes),
                            self.cumulative_logprob)
