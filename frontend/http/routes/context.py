"""What every route module shares: the app's context (the serving context, the flags and the
records the app opened), the error boundary and the JSON answer."""

from __future__ import annotations

import logging

import msgspec
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import Response

from frontend.base.errors import APIError, error_response, route_path
from frontend.batches.api import Batches
from frontend.http.decoding import decode_body
from frontend.http.limits import Admission
from frontend.http.readiness import Readiness
from frontend.input.input_bounds import RequestLimits
from frontend.pipeline.serving_context import ServingContext
from frontend.responses.shared import Responses
from shared.config import FrontendConfig

log = logging.getLogger("sluice.frontend")
_json = msgspec.json.Encoder()


class AppContext(msgspec.Struct, frozen=True):
    """One app's parts, built once by `build_app` and read by every route module."""

    ctx: ServingContext
    config: FrontendConfig
    limits: RequestLimits
    admission: Admission
    readiness: Readiness
    metrics: CollectorRegistry
    responses: Responses
    batches: Batches
    keys: frozenset[str]  # API keys; where set, each owns what it stores

    async def decode(self, request: Request, body_type):
        """The request's body as `body_type`, within the server's JSON depth."""
        return await decode_body(request, body_type, self.limits.max_json_depth)


def json_response(body) -> Response:
    return Response(_json.encode(body), media_type="application/json")


def guarded(handler):
    """The error boundary: an APIError is its status and shape, anything else a logged 500."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return error_response(exc, route_path(request.scope))
        except Exception:
            log.exception("unhandled error in %s", route_path(request.scope))
            return error_response(APIError(500, "internal server error"), route_path(request.scope))

    return endpoint
