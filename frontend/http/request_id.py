"""vLLM's X-Request-Id: the header names the request, and every response echoes it.

Each HTTP request also opens its log context (`shared.log_format`): the lines logged while
it is served, uvicorn's access line included, carry its id under `--log-format json`: the
header's, or a fresh one the request then takes (`with_request_id`), until the pipeline
names the engine request it makes (`chatcmpl-<that id>`).
"""

from __future__ import annotations

import uuid

import msgspec
from starlette.requests import Request

from shared.log_format import close_request, current_request_id, name_request, open_request

REQUEST_ID_HEADER = "x-request-id"


def with_request_id(request: Request, body):
    """The header, when sent, is the request id (over the body's); without either, the one
    its log lines already carry."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given:
        name_request(given)
        return msgspec.structs.replace(body, request_id=given)
    if body.request_id is None and current_request_id() is not None:
        return msgspec.structs.replace(body, request_id=current_request_id())
    return body


class RequestIdMiddleware:
    """Echoes a request's X-Request-Id on its response, errors and refusals included."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((value for name, value in scope["headers"]
                      if name == REQUEST_ID_HEADER.encode()), None)
        token = open_request(given.decode("latin-1") if given else uuid.uuid4().hex)
        try:
            await self._serve(scope, receive, send, given)
        finally:
            close_request(token)

    async def _serve(self, scope, receive, send, given: bytes | None) -> None:
        if given is None:
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message,
                           "headers": [*message.get("headers", []),
                                       (REQUEST_ID_HEADER.encode(), given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
