"""RequestTracker: what each frame does to the request metrics (single-process registry)."""

from __future__ import annotations

import asyncio

from frontend.engine_client import request_metrics as m
from frontend.engine_client.admission import Admission, Ticket, current_ticket
from frontend.engine_client.tracking import RequestTracker
from shared.protocol import EngineRequest, SamplingParams, TextFrame


def _frame(n: int, finish: str | None = None, **kw) -> TextFrame:
    return TextFrame(request_id="r", seq=n, text="x", token_ids=b"", num_prompt_tokens=5,
                     num_output_tokens=n, finish_reason=finish, **kw)


def _request() -> EngineRequest:
    return EngineRequest("r", b"", SamplingParams(max_tokens=3), "ipc://x", 0.0)


def _count(histogram) -> float:
    return next(s.value for s in histogram.collect()[0].samples if s.name.endswith("_count"))


class FakeClient:
    def __init__(self) -> None:
        self.failed: list[tuple[str, int]] = []

    async def fail_request(self, request_id: str, message: str, status: int) -> None:
        self.failed.append((request_id, status))


def test_a_request_observed_from_ticket_to_last_token():
    async def run():
        admission = Admission(max_queued=4)
        admission.queued = 1  # as the middleware left it
        ticket = Ticket(admission, arrived=asyncio.get_running_loop().time())
        current_ticket.set(ticket)
        tracker = RequestTracker(FakeClient())
        before = (_count(m.TIME_TO_FIRST_TOKEN), _count(m.INTER_TOKEN_LATENCY),
                  _count(m.E2E_LATENCY))
        tracker.submitted(_request())
        tracker.delivered(_frame(1))
        assert not ticket.waiting and admission.queued == 0  # the first token ends the wait
        tracker.delivered(_frame(3, "length"))  # two tokens in one frame: two gaps
        after = (_count(m.TIME_TO_FIRST_TOKEN), _count(m.INTER_TOKEN_LATENCY),
                 _count(m.E2E_LATENCY))
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 2, 1]
        tracker.delivered(_frame(4, "length"))  # after the end: ignored
        assert _count(m.E2E_LATENCY) == after[2]

    asyncio.run(run())


def test_the_timeout_fails_the_request_and_a_finish_cancels_it():
    async def run():
        client = FakeClient()
        tracker = RequestTracker(client)
        tracker.request_timeout_s = 0.05
        tracker.submitted(_request())
        await asyncio.sleep(0.2)
        assert client.failed == [("r", 504)]
        tracker.ended("r", None)
        tracker.submitted(_request())
        tracker.delivered(_frame(1, "stop"))
        await asyncio.sleep(0.2)
        assert client.failed == [("r", 504)]  # finished in time: no second failure

    asyncio.run(run())


def _sum(histogram) -> float:
    return next(s.value for s in histogram.collect()[0].samples if s.name.endswith("_sum"))


def test_time_to_first_token_is_the_engines_stamp_not_the_frames_arrival():
    """req O-8: a postproc worker's hop between the engine and here is not in the TTFT."""
    import time

    async def run():
        current_ticket.set(None)
        tracker = RequestTracker(FakeClient())
        tracker.submitted(_request())
        stamped = time.time() + 0.05  # the engine's first token, 50 ms in
        await asyncio.sleep(0.3)  # ...reaching the frontend much later
        before = _sum(m.TIME_TO_FIRST_TOKEN)
        tracker.delivered(_frame(1, first_token_time=stamped))
        ttft = _sum(m.TIME_TO_FIRST_TOKEN) - before
        assert 0.04 < ttft < 0.2
        # A stamp from a clock ahead of ours is bounded by the arrival here.
        tracker.submitted(EngineRequest("q", b"", SamplingParams(max_tokens=3), "ipc://x", 0.0))
        before = _sum(m.TIME_TO_FIRST_TOKEN)
        tracker.delivered(TextFrame(request_id="q", seq=0, text="x", token_ids=b"",
                                    num_prompt_tokens=5, num_output_tokens=1,
                                    first_token_time=time.time() + 3600))
        assert _sum(m.TIME_TO_FIRST_TOKEN) - before < 0.2

    asyncio.run(run())
