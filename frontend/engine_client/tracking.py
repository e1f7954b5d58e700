"""Follows each engine request from submission to its last frame, for the request metrics
(req L-3), the queue cap (its ticket leaves the queue at the first token) and the
per-request timeout (--request-timeout).

`EngineClient` calls `submitted`, `delivered` (every frame it hands to a request, errors
included) and `ended` (abort or release); everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from frontend.engine_client import request_metrics as m
from frontend.engine_client.admission import KeyMeter, Ticket, current_meter, current_ticket
from frontend.engine_client.request_log import RequestLog
from shared.protocol import EngineRequest, TextFrame


class Timing(msgspec.Struct):
    arrived: float  # time.monotonic() when the HTTP request arrived (or was submitted)
    ticket: Ticket | None
    arrived_wall: float = 0.0  # the same moment by time.time(), the engine's clock
    first_token: float | None = None
    last_token: float = 0.0
    tokens: int = 0
    deadline: asyncio.TimerHandle | None = None
    meter: KeyMeter | None = None  # a keys-file key's request: its tokens, for its budget


class RequestTracker:
    def __init__(self, client) -> None:
        self.client = client  # the EngineClient: fail_request ends a timed-out request
        self.request_timeout_s: float | None = None
        self._timings: dict[str, Timing] = {}
        self._expiring: set[asyncio.Task] = set()
        self.request_log: RequestLog | None = None  # --enable-log-requests

    def submitted(self, request: EngineRequest) -> None:
        ticket = current_ticket.get()
        now = time.monotonic()
        timing = Timing(ticket.arrived if ticket is not None else now, ticket)
        timing.arrived_wall = time.time() - (now - timing.arrived)
        timing.meter = current_meter.get()
        if self.request_timeout_s is not None:
            delay = max(0.0, timing.arrived + self.request_timeout_s - now)
            timing.deadline = asyncio.get_running_loop().call_later(
                delay, self._expire, request.request_id)
        self._timings[request.request_id] = timing
        if self.request_log is not None:
            self.request_log.sent(request)

    def arrived(self, request_id: str) -> float | None:
        """When the request arrived (time.monotonic()), while it is followed."""
        timing = self._timings.get(request_id)
        return timing.arrived if timing is not None else None

    def delivered(self, frame: TextFrame) -> None:
        if self.request_log is not None:
            self.request_log.frame(frame)
        timing = self._timings.get(frame.request_id)
        if timing is None:
            return
        if timing.meter is not None:
            timing.meter.saw(frame.request_id, frame.num_prompt_tokens, frame.num_output_tokens)
        now = time.monotonic()
        new = frame.num_output_tokens - timing.tokens
        if new > 0:
            self._tokens(timing, new, now, frame.first_token_time)
            timing.tokens = frame.num_output_tokens
        if frame.finish_reason is not None:
            self._finished(frame, timing, now)

    def ended(self, request_id: str, reason: str | None) -> None:
        """The request stopped without a last frame: aborted ("abort") or just released."""
        if self.request_log is not None:
            self.request_log.finished(request_id)
        timing = self._timings.pop(request_id, None)
        if timing is None:
            return
        self._close(timing)
        if reason is not None:
            m.REQUEST_SUCCESS.labels(reason).inc()

    def _tokens(self, timing: Timing, new: int, now: float,
                engine_stamp: float | None) -> None:
        m.GENERATION_TOKENS_TOTAL.inc(new)
        if timing.first_token is None:
            timing.first_token = now
            m.TIME_TO_FIRST_TOKEN.observe(_ttft(timing, now, engine_stamp))
            if timing.ticket is not None:
                timing.ticket.started()
        else:
            # One observation per token, as vLLM: a frame holding k tokens spreads its gap.
            gap = (now - timing.last_token) / new
            for _ in range(new):
                m.INTER_TOKEN_LATENCY.observe(gap)
        timing.last_token = now

    def _finished(self, frame: TextFrame, timing: Timing, now: float) -> None:
        del self._timings[frame.request_id]
        self._close(timing)
        if frame.finish_reason == "error":
            m.REQUEST_ERRORS.labels(str(frame.error_status or 500)).inc()
            return
        m.E2E_LATENCY.observe(now - timing.arrived)
        m.PROMPT_TOKENS.observe(frame.num_prompt_tokens)
        m.PROMPT_TOKENS_TOTAL.inc(frame.num_prompt_tokens)
        m.GENERATION_TOKENS.observe(frame.num_output_tokens)
        m.REQUEST_SUCCESS.labels(frame.finish_reason).inc()

    @staticmethod
    def _close(timing: Timing) -> None:
        if timing.deadline is not None:
            timing.deadline.cancel()

    def _expire(self, request_id: str) -> None:
        message = (f"The request took longer than --request-timeout "
                   f"({self.request_timeout_s:g} s) and was stopped.")
        task = asyncio.ensure_future(self.client.fail_request(request_id, message, 504))
        self._expiring.add(task)  # keep a reference until it is done
        task.add_done_callback(self._expiring.discard)


def _ttft(timing: Timing, now: float, engine_stamp: float | None) -> float:
    """Time to first token as the engine stamped it, before any post-processing (req
    O-8: a postproc worker's hop is not the model's latency). Without a stamp, or with clocks
    that disagree (engine on another machine), the frame's arrival here bounds it."""
    arrival_bound = now - timing.arrived
    if engine_stamp is None:
        return arrival_bound
    return min(max(engine_stamp - timing.arrived_wall, 0.0), arrival_bound)
