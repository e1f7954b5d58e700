"""Anthropic's Messages face: /v1/messages and /v1/messages/count_tokens (its Message
Batches are in `routes/batches.py`, over the batch runner)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.anthropic import api as anthropic_api
from frontend.anthropic.models import CountTokensRequest, MessagesRequest
from frontend.http.routes.context import AppContext, guarded, json_response


def routes(app: AppContext) -> list[Route]:
    async def messages(request: Request) -> Response:
        body = await app.decode(request, MessagesRequest)
        return await anthropic_api.create(app.ctx, request, body)

    async def count_tokens(request: Request) -> Response:
        body = await app.decode(request, CountTokensRequest)
        return json_response(await anthropic_api.count_tokens(app.ctx, body))

    return [Route("/v1/messages", guarded(messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", guarded(count_tokens), methods=["POST"])]
