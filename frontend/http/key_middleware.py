"""`--api-keys-file` as two ASGI middlewares, where `--api-key`'s check was.

- `KeyAuthMiddleware` (before any body is read): who the request is (`KeyTable.lookup`), a
  401 for a missing, unknown or expired key; the principal goes on in the scope
  (`PRINCIPAL`), where `owner_of` reads whose stored objects it may see.
- `KeyLimitMiddleware` (after the body limit, before the queue): a file entry's limits
  (`KeyLimiter.admit`); every answer carries OpenAI's `x-ratelimit-*` headers, a refusal is
  a 429 with `Retry-After`; the request's tokens are metered (`KeyMeter`, filled by the
  request tracker) and settled when it ends, a stream's when it ends or is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
from starlette.responses import Response

from frontend.base.errors import APIError, error_response, is_anthropic_path, route_path
from frontend.base.principal import PRINCIPAL
from frontend.engine_client import request_metrics as m
from frontend.engine_client.admission import KeyMeter, current_meter
from frontend.http import key_metrics as km
from frontend.http.key_limits import Admitted, KeyLimiter, Refusal, Shape
from frontend.http.key_table import KeyTable, Principal, presented_keys
from frontend.http.limits import OPEN_PATHS, reject

_shape = msgspec.json.Decoder(Shape)
_TYPES = {429: "rate_limit_exceeded", 404: "invalid_request_error", 503: "service_unavailable"}


class _OpenAIError(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str


class _OpenAIErrorBody(msgspec.Struct):
    error: _OpenAIError


def refusal_response(error: APIError, path: str, headers: dict[str, str]) -> Response:
    """OpenAI's error body with the limit's name as `code` (Anthropic's shape on
    /v1/messages, which has no such field)."""
    code = getattr(error, "code", None)
    if code is None or is_anthropic_path(path):
        response = error_response(error, path)
    else:
        body = _OpenAIErrorBody(_OpenAIError(error.message, _TYPES.get(error.status, "error"),
                                             error.param, code))
        response = Response(msgspec.json.encode(body), error.status,
                            media_type="application/json")
    response.headers.update(headers)
    return response


class KeyAuthMiddleware:
    def __init__(self, app, table: KeyTable, clock=time.time) -> None:
        self.app = app
        self.table = table
        self.clock = clock

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        principal = self._principal(scope)
        if principal is None:
            error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                                  "KEY' or 'x-api-key: KEY'.")
            return await reject(scope, receive, send, error, "unauthorized",
                                {"WWW-Authenticate": "Bearer"})
        if principal.expired(self.clock()):
            km.REFUSALS.labels(principal.name, "expired").inc()
            error = APIError(401, f"API key '{principal.name}' expired at "
                                  f"{principal.entry.expires.isoformat()}.")
            return await reject(scope, receive, send, error, "expired")
        scope[PRINCIPAL] = principal
        await self.app(scope, receive, send)

    def _principal(self, scope) -> Principal | None:
        found = [self.table.lookup(key) for key in presented_keys(scope)]
        return next((p for p in found if p is not None), None)


class KeyLimitMiddleware:
    def __init__(self, app, limiter: KeyLimiter) -> None:
        self.app = app
        self.limiter = limiter
        self._settling: set[asyncio.Task] = set()

    async def __call__(self, scope, receive, send) -> None:
        principal = scope.get(PRINCIPAL) if scope["type"] == "http" else None
        if principal is None or principal.entry is None:  # open path, or an --api-key key
            return await self.app(scope, receive, send)
        body = None
        if scope["method"] in ("POST", "PUT", "PATCH"):
            message = await receive()  # the body limit replays the whole body at once
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
        admitted = await self._admit(scope, receive, send, principal, body)
        if admitted is None:
            return
        km.REQUESTS.labels(principal.name).inc()
        meter = KeyMeter(priority_floor=principal.entry.priority)
        token = current_meter.set(meter)
        try:
            await self.app(scope, _replay(receive, admitted.body or body),
                           _with_headers(send, admitted.headers))
        finally:
            current_meter.reset(token)
            # Its own task, so a cancelled request (the client left) still settles.
            task = asyncio.ensure_future(self.limiter.settle(admitted, *meter.totals()))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _admit(self, scope, receive, send, principal: Principal,
                     body: bytes | None) -> Admitted | None:
        path = route_path(scope)
        shape = None
        if body:
            with contextlib.suppress(msgspec.DecodeError):
                shape = _shape.decode(body)
        try:
            return await self.limiter.admit(principal, path, body, shape)
        except Refusal as refusal:
            reason, headers = refusal.code, refusal.headers
            error = refusal
        except APIError as error_:
            reason, headers, error = "max_tokens_per_request", {}, error_
        km.REFUSALS.labels(principal.name, reason).inc()
        m.REJECTED.labels(reason).inc()
        await refusal_response(error, path, headers)(scope, receive, send)
        return None


def _replay(receive, body: bytes | None):
    """The body again, as one message (or the original receive for a bodiless request)."""
    if body is None:
        return receive
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _with_headers(send, headers: dict[str, str]):
    if not headers:
        return send
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]

    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *raw]}
        await send(message)

    return sending
