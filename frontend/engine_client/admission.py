"""This frontend's admission state: the queue cap's count and the ticket each POST holds.

A POST holds a `Ticket` from arrival until its first generated token (or its end); the
HTTP middleware (`frontend.http.limits`) issues it and sets it in `current_ticket`, the
request tracker (`frontend.engine_client.tracking`) ends its wait when the first token arrives.
It lives here, below both, so the tracker need not import the HTTP layer.
"""

from __future__ import annotations

from contextvars import ContextVar

import msgspec

from frontend.engine_client import request_metrics as m


class Admission:
    def __init__(self, max_queued: int | None) -> None:
        self.max_queued = max_queued
        self.queued = 0
        self.in_flight = 0
        self.draining = False

    def full(self) -> bool:
        return self.max_queued is not None and self.queued >= self.max_queued


class Ticket(msgspec.Struct):
    """One admitted POST: queued until its first token arrives or it ends."""

    admission: Admission
    arrived: float  # time.monotonic() at admission: request timeouts count from here
    waiting: bool = True

    def started(self) -> None:
        if self.waiting:
            self.waiting = False
            self.admission.queued -= 1
            m.QUEUED.dec()


current_ticket: ContextVar[Ticket | None] = ContextVar("sluice_ticket", default=None)


class KeyMeter(msgspec.Struct):
    """What one request of a keys-file key (`frontend.http.key_limits`) used, for settling
    its tokens-per-minute budget at its end: each engine request's latest prompt and output
    token counts (n > 1 and retries count once per engine request). `priority_floor`: the
    key's priority, the best (lowest) an engine request of it may ask for."""

    priority_floor: int = 0
    prompt: dict[str, int] = {}
    output: dict[str, int] = {}

    def saw(self, request_id: str, prompt_tokens: int, output_tokens: int) -> None:
        self.prompt[request_id] = max(prompt_tokens, self.prompt.get(request_id, 0))
        self.output[request_id] = max(output_tokens, self.output.get(request_id, 0))

    def totals(self) -> tuple[int, int]:
        return sum(self.prompt.values()), sum(self.output.values())


current_meter: ContextVar[KeyMeter | None] = ContextVar("sluice_key_meter", default=None)
