"""The Responses face's routes: /v1/responses (stored, background, resumed streams) and
/v1/conversations with their items."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.base.errors import APIError
from frontend.http.request_id import with_request_id
from frontend.http.routes.context import AppContext, guarded, json_response
from frontend.responses import api as responses_api
from frontend.responses import conversation_api
from frontend.responses.conversation_models import (
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
)
from frontend.responses.models import InputTokensRequest, ResponsesRequest


def routes(app: AppContext) -> list[Route]:
    return [*_response_routes(app), *_conversation_routes(app)]


def _response_routes(app: AppContext) -> list[Route]:
    ctx, responses = app.ctx, app.responses

    async def create(request: Request) -> Response:
        body = with_request_id(request, await app.decode(request, ResponsesRequest))
        return await responses_api.create(ctx, request, body, responses)

    async def input_tokens(request: Request) -> Response:
        body = await app.decode(request, InputTokensRequest)
        return json_response(await responses_api.input_tokens(ctx, request, body, responses))

    async def compact(request: Request) -> Response:
        raise APIError(404, "/v1/responses/compact is not supported by this server.")

    async def get(request: Request) -> Response:
        stream, after = responses_api.stream_query(request)
        if stream:  # a background response's events, stored and then live
            return await responses_api.resume_stream(
                ctx, request, responses, request.path_params["response_id"], after)
        return json_response(await responses_api.retrieve(
            ctx, request, responses, request.path_params["response_id"]))

    async def delete(request: Request) -> Response:
        return json_response(await responses_api.delete(
            request, responses, request.path_params["response_id"]))

    async def cancel(request: Request) -> Response:
        return json_response(await responses_api.cancel(
            request, responses, request.path_params["response_id"]))

    async def input_items(request: Request) -> Response:
        return json_response(await responses_api.input_items(
            request, responses, request.path_params["response_id"]))

    # Literal paths before parameterised ones (req R-2): Starlette answers with the first
    # route whose pattern and method match, and `{response_id}` matches any one path
    # segment, so a parameterised route listed first would take a literal path it shares a
    # method with (`/v1/responses/input_tokens` read as a response id, as would any literal
    # added later beside `{response_id}` or `{batch_id}`).
    return [
        Route("/v1/responses", guarded(create), methods=["POST"]),
        Route("/v1/responses/input_tokens", guarded(input_tokens), methods=["POST"]),
        Route("/v1/responses/compact", guarded(compact), methods=["POST"]),
        Route("/v1/responses/{response_id}", guarded(get), methods=["GET"]),
        Route("/v1/responses/{response_id}", guarded(delete), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", guarded(cancel), methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", guarded(input_items),
              methods=["GET"]),
    ]


def _conversation_routes(app: AppContext) -> list[Route]:
    responses = app.responses

    async def create(request: Request) -> Response:
        body = await app.decode(request, ConversationCreate)
        return json_response(await conversation_api.create(request, body, responses))

    async def get(request: Request) -> Response:
        return json_response(await conversation_api.retrieve(
            request, responses, request.path_params["conversation_id"]))

    async def update(request: Request) -> Response:
        body = await app.decode(request, ConversationUpdate)
        return json_response(await conversation_api.update(
            request, body, responses, request.path_params["conversation_id"]))

    async def delete(request: Request) -> Response:
        return json_response(await conversation_api.delete(
            request, responses, request.path_params["conversation_id"]))

    async def items(request: Request) -> Response:
        return json_response(await conversation_api.list_items(
            request, responses, request.path_params["conversation_id"]))

    async def items_add(request: Request) -> Response:
        body = await app.decode(request, ItemsCreate)
        return json_response(await conversation_api.add_items(
            request, body, responses, request.path_params["conversation_id"]))

    async def item_get(request: Request) -> Response:
        return json_response(await conversation_api.retrieve_item(
            request, responses, request.path_params["conversation_id"],
            request.path_params["item_id"]))

    async def item_delete(request: Request) -> Response:
        return json_response(await conversation_api.delete_item(
            request, responses, request.path_params["conversation_id"],
            request.path_params["item_id"]))

    conversation = "/v1/conversations/{conversation_id}"
    return [
        Route("/v1/conversations", guarded(create), methods=["POST"]),
        Route(conversation, guarded(get), methods=["GET"]),
        Route(conversation, guarded(update), methods=["POST"]),
        Route(conversation, guarded(delete), methods=["DELETE"]),
        Route(f"{conversation}/items", guarded(items), methods=["GET"]),
        Route(f"{conversation}/items", guarded(items_add), methods=["POST"]),
        Route(f"{conversation}/items/{{item_id}}", guarded(item_get), methods=["GET"]),
        Route(f"{conversation}/items/{{item_id}}", guarded(item_delete), methods=["DELETE"]),
    ]
