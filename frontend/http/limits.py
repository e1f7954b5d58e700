"""Admission control as ASGI middleware: request body size, the queue cap, and the drain.

- Bodies above --max-request-body-bytes get a 413 before the app parses anything.
- A POST holds a `Ticket` (`frontend.engine_client.admission`) from arrival until its first
  generated token (or its end): those are this frontend's queued requests. Beyond
  --max-queued-requests new ones get a 503 with Retry-After, so a load balancer or client
  backs off instead of piling work on an engine that cannot start it. The ticket
  travels to `EngineClient.submit` in a context variable.
- While draining (SIGTERM), everything but the open routes gets a 503 and `/health` says
  503, so balancers take the frontend out while its in-flight requests finish.
"""

from __future__ import annotations

import asyncio
import logging
import time

from frontend.base.errors import APIError, error_response, route_path
from frontend.engine_client import request_metrics as m
from frontend.engine_client.admission import Admission, Ticket, current_ticket
from shared import config as shared_config

log = logging.getLogger("sluice.frontend")

OPEN_PATHS = frozenset(shared_config.OPEN_PATHS)
RETRY_AFTER_S = 1
# A draining frontend's 503s, /health's included: retry in a second, on a new connection
# (the balancer sends it to another replica).
DRAINING_HEADERS = {"Connection": "close", "Retry-After": str(RETRY_AFTER_S)}


async def reject(scope, receive, send, error: APIError, reason: str, headers=None) -> None:
    m.REJECTED.labels(reason).inc()
    response = error_response(error, route_path(scope))
    response.headers.update(headers or {})
    await response(scope, receive, send)


class AdmissionMiddleware:
    def __init__(self, app, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        admission = self.admission
        if admission.draining:
            error = APIError(503, "The server is shutting down; send the request elsewhere.")
            return await reject(scope, receive, send, error, "draining", DRAINING_HEADERS)
        ticket = token = None
        if scope["method"] == "POST":
            if admission.full():
                error = APIError(503, f"Too many queued requests (--max-queued-requests "
                                      f"{admission.max_queued}); retry shortly.")
                return await reject(scope, receive, send, error, "queue_full",
                                    {"Retry-After": str(RETRY_AFTER_S)})
            ticket = Ticket(admission, time.monotonic())
            admission.queued += 1
            m.QUEUED.inc()
            token = current_ticket.set(ticket)
        admission.in_flight += 1
        m.IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            admission.in_flight -= 1
            m.IN_FLIGHT.dec()
            if ticket is not None:
                ticket.started()  # ended without a token: it leaves the queue all the same
                current_ticket.reset(token)


class BodyLimitMiddleware:
    """Reads a request body up to the limit, then replays it to the app in one message."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if _content_length(scope) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending it all: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:  # chunked bodies declare no length
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later calls wait for the disconnect, as usual
            replayed = True
            return whole

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        error = APIError(413, f"The request body is larger than {self.max_bytes} bytes "
                              f"(--max-request-body-bytes).")
        # The unread rest of the body would be parsed as the next request: close instead.
        await reject(scope, receive, send, error, "body_too_large", {"Connection": "close"})


def _content_length(scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0  # the HTTP parser refuses such requests before they get here
    return 0


async def drain(admission: Admission, client, timeout_s: float) -> None:
    """Stop admitting, let in-flight requests finish for up to timeout_s, then end the rest
    with an error (a stream gets an error event and [DONE]) so no client is cut off silently."""
    admission.draining = True
    log.info("draining: %d requests in flight, up to %.0fs", admission.in_flight, timeout_s)
    deadline = time.monotonic() + timeout_s
    while admission.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if admission.in_flight:
        log.warning("drain timeout: ending %d requests", admission.in_flight)
        # Named apart from the refusal above and the engine client's 503s: a request that
        # outlasted the window, so whoever reads it knows which limit ended it.
        message = (f"The server is shutting down and the request ran past its drain window "
                   f"(--shutdown-timeout {timeout_s:g} s).")
        for request_id in client.active_request_ids():
            await client.fail_request(request_id, message, 503)
        grace = time.monotonic() + 2  # let the error frames reach their clients
        while admission.in_flight and time.monotonic() < grace:
            await asyncio.sleep(0.05)
    log.info("drained")
