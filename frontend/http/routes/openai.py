"""OpenAI's own routes (models, chat completions, completions), SageMaker's /invocations that
picks one of the two, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.base.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from frontend.base.errors import APIError
from frontend.base.principal import principal_of
from frontend.http import lora as lora_routes
from frontend.http.request_id import with_request_id
from frontend.http.routes.context import AppContext, guarded, json_response
from frontend.openai import serving
from frontend.pipeline.serving_context import check_model
from postproc.openai_shapes import ModelCard, ModelList


class _InvocationShape(msgspec.Struct):
    """What /invocations reads to pick a route (other fields pass, unread)."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


def _given(raw: msgspec.Raw) -> bool:
    return bytes(raw) not in (b"", b"null")


def routes(app: AppContext) -> list[Route]:
    return [*_model_routes(app), *_lora_routes(app), *_generation_routes(app),
            *_token_routes(app)]


def _model_routes(app: AppContext) -> list[Route]:
    ctx = app.ctx

    def model_card(name: str) -> ModelCard:
        stats = ctx.client.stats
        return ModelCard(id=name, created=ctx.started, root=ctx.model_source,
                         max_model_len=stats.max_model_len if stats else 0)

    def lora_cards() -> list[ModelCard]:
        stats = ctx.client.stats
        return lora_routes.lora_cards(ctx, stats.max_model_len if stats else 0)

    async def models(request: Request) -> Response:
        # One card per served name, as vLLM lists them, then the engines' LoRA adapters;
        # a keys-file key with `models` sees only those (frontend.http.key_table).
        cards = [model_card(name) for name in (ctx.model_name, *ctx.model_aliases)]
        entry = getattr(principal_of(request.scope), "entry", None)
        allowed = entry.models if entry is not None else None
        return json_response(ModelList([c for c in cards + lora_cards()
                                        if allowed is None or c.id in allowed]))

    async def model(request: Request) -> Response:
        # The client's models.retrieve(); `:path` so a Hub id (org/name) is one model id.
        name = request.path_params["model_id"]
        check_model(ctx, name)
        card = next((c for c in lora_cards() if c.id == name), None)
        return json_response(card or model_card(name))

    return [Route("/v1/models", guarded(models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", guarded(model), methods=["GET"])]


def _lora_routes(app: AppContext) -> list[Route]:
    """vLLM's run-time adapter routes (issue 36), behind --allow-runtime-lora-updating."""
    if not app.config.allow_runtime_lora_updating:
        return []
    load_lora, unload_lora = lora_routes.routes(app.ctx, app.decode)
    return [Route("/v1/load_lora_adapter", guarded(load_lora), methods=["POST"]),
            Route("/v1/unload_lora_adapter", guarded(unload_lora), methods=["POST"])]


def _generation_routes(app: AppContext) -> list[Route]:
    async def chat(request: Request) -> Response:
        body = with_request_id(request, await app.decode(request, ChatCompletionRequest))
        return await serving.chat_completion(app.ctx, request, body)

    async def completions(request: Request) -> Response:
        body = with_request_id(request, await app.decode(request, CompletionRequest))
        return await serving.completion(app.ctx, request, body)

    async def invocations(request: Request) -> Response:
        # SageMaker's one route, routed by the body's shape as vLLM does (the first request
        # type the body fits, chat before completions); the route then decodes it strictly.
        shape = await app.decode(request, _InvocationShape)
        if _given(shape.messages):
            return await chat(request)
        if _given(shape.prompt):
            return await completions(request)
        raise APIError(400, "Cannot route this /invocations body: send a chat completion "
                            "(with messages) or a completion (with prompt).")

    return [Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
            Route("/v1/completions", guarded(completions), methods=["POST"]),
            Route("/invocations", guarded(invocations), methods=["POST"])]


def _token_routes(app: AppContext) -> list[Route]:
    async def tokenize(request: Request) -> Response:
        body = await app.decode(request, TokenizeRequest)
        return json_response(await serving.tokenize(app.ctx, body))

    async def detokenize(request: Request) -> Response:
        body = await app.decode(request, DetokenizeRequest)
        return json_response(await serving.detokenize(app.ctx, body))

    return [Route("/tokenize", guarded(tokenize), methods=["POST"]),
            Route("/detokenize", guarded(detokenize), methods=["POST"])]
