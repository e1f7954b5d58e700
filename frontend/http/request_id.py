"""vLLM's X-Request-Id: the header names the request, and every response echoes it."""

from __future__ import annotations

import msgspec
from starlette.requests import Request

REQUEST_ID_HEADER = "x-request-id"


def with_request_id(request: Request, body):
    """The header, when sent, is the request id (over the body's)."""
    given = request.headers.get(REQUEST_ID_HEADER)
    return msgspec.structs.replace(body, request_id=given) if given else body


class RequestIdMiddleware:
    """Echoes a request's X-Request-Id on its response, errors and refusals included."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((value for name, value in scope["headers"]
                      if name == REQUEST_ID_HEADER.encode()), None)
        if given is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message,
                           "headers": [*message.get("headers", []),
                                       (REQUEST_ID_HEADER.encode(), given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
