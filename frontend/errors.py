"""One error body shape for every route (OpenAI's) and the status codes clients rely on."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from frontend.api_models import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


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


def error_response(error: APIError) -> Response:
    body = msgspec.json.encode(error_body(error.status, error.message, error.param))
    return Response(body, status_code=error.status, media_type="application/json")
