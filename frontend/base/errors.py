"""Error bodies and the status codes clients rely on (req R-3).

Every route answers in OpenAI's shape, except the Anthropic-compatible ones (`/v1/messages`
and below), which answer in Anthropic's (`{"type": "error", "error": {"type", "message"}}`),
so each API's own client can read them; the middleware (auth, limits) and Starlette's own
404/405 pick the shape by path too (`error_response(..., path)`).
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from postproc.openai_shapes import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# Anthropic's error types by status (their 529 "overloaded" is our 503).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


# Anthropic's error shape lives here, below every face, since the middleware answers in it
# too; `frontend.anthropic.models` re-exports it beside its other bodies.
class ErrorDetail(msgspec.Struct):
    type: str
    message: str


class ErrorBody(msgspec.Struct, tag="error", tag_field="type"):
    """Anthropic's error shape, as a response body and as a stream's `error` event."""

    error: ErrorDetail


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(ErrorInfo(message, _TYPES.get(status, "error"), param, status))


def anthropic_error_body(status: int, message: str) -> ErrorBody:
    return ErrorBody(ErrorDetail(_ANTHROPIC_TYPES.get(status, "api_error"), message))


def route_path(scope) -> str:
    """The path routes match. Under --root-path uvicorn puts the prefix in front of the
    client's path; Starlette's router takes it off again, and so must anything else that
    looks at paths (open paths, error shapes)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_response(error: APIError, path: str = "") -> Response:
    if is_anthropic_path(path):
        body = msgspec.json.encode(anthropic_error_body(error.status, error.message))
    else:
        body = msgspec.json.encode(error_body(error.status, error.message, error.param))
    return Response(body, status_code=error.status, media_type="application/json")
