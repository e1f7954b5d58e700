"""The HTTP surface: routes, body decoding and the error boundary. Handlers stay thin."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend.anthropic import api as anthropic_api
from frontend.anthropic.models import CountTokensRequest, MessagesRequest
from frontend.base.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from frontend.base.errors import APIError, error_response, route_path
from frontend.batches import anthropic_batches
from frontend.batches import api as batches_api
from frontend.batches.models import AnthropicBatchCreate, BatchCreate
from frontend.batches.records import BatchRecords, FileRecords
from frontend.batches.runner import BatchRunner
from frontend.embeddings import embeddings as embeddings_api
from frontend.embeddings import scoring as scoring_api
from frontend.http import lora as lora_routes
from frontend.http import openapi
from frontend.http.auth import AuthMiddleware
from frontend.http.field_hints import closest_field
from frontend.http.limits import Admission, AdmissionMiddleware, BodyLimitMiddleware
from frontend.http.metrics import metrics_registry, render
from frontend.http.readiness import Readiness
from frontend.input.input_bounds import RequestLimits, json_depth_error
from frontend.input.json_depth import TooDeep, check_depth
from frontend.openai import serving
from frontend.pipeline.serving_context import ServingContext, check_model
from frontend.responses import api as responses_api
from frontend.responses import conversation_api
from frontend.responses.background import BackgroundRunner
from frontend.responses.conversation_models import (
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
)
from frontend.responses.conversations import ConversationRecords
from frontend.responses.models import InputTokensRequest, ResponsesRequest
from frontend.responses.stored import ResponseRecords, owner_of
from frontend.state.store import open_store
from postproc.openai_shapes import ModelCard, ModelList
from shared.config import FrontendConfig
from shared.runner_config import resolve_runner

log = logging.getLogger("sluice.frontend")
_json = msgspec.json.Encoder()
VERSION = "0.1.0"


def _check_media_type(request: Request) -> None:
    """A body sent as something other than JSON (curl -d's form encoding, say) is a 415, as
    in vLLM; with no Content-Type at all the body is read as JSON."""
    given = request.headers.get("content-type")
    if given is None:
        return
    media_type = given.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"Unsupported Media Type {media_type!r}: send the body as "
                            "application/json")


async def _decode(request: Request, body_type, max_json_depth: int):
    _check_media_type(request)
    body = await request.body()
    try:
        # Before msgspec, which recurses per level (and every walk after it): a flat scan.
        check_depth(body, max_json_depth)
        return msgspec.json.decode(body, type=body_type)
    except TooDeep as exc:
        raise json_depth_error(exc) from exc
    except msgspec.ValidationError as exc:
        raise APIError(400, f"Invalid request: {exc}{_hint(body_type, str(exc))}",
                       _param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the scan should have stopped it; never a 500
        raise APIError(400, "The request body nests too deeply") from exc


_FIELD_PROBLEM = re.compile(r"Object (?:contains unknown|missing required) field `([^`]*)`")


def _param_of(message: str) -> str | None:
    """The request field a msgspec validation error is about, as a dotted path.

    msgspec says e.g. "Object contains unknown field `temprature` - at `$`",
    "Expected `int`, got `str` - at `$.n`" or "... - at `$.messages[0]`".
    """
    path = ""
    if " - at `$" in message:
        path = message.rsplit(" - at `$", 1)[1].rstrip("`").lstrip(".")
    named = _FIELD_PROBLEM.match(message)
    if named:
        return f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$([^`]*)`)?")


def _hint(body_type, message: str) -> str:
    """For an unknown field: the closest known one at the same place, if any is close."""
    unknown = _UNKNOWN_FIELD.match(message)
    if unknown is None:
        return ""
    known = closest_field(body_type, (unknown.group(2) or "").lstrip("."), unknown.group(1))
    return f' (did you mean "{known}"?)' if known else ""


class _InvocationShape(msgspec.Struct):
    """What /invocations reads to pick a route (other fields pass, unread)."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


def _given(raw: msgspec.Raw) -> bool:
    return bytes(raw) not in (b"", b"null")


REQUEST_ID_HEADER = "x-request-id"


def _with_request_id(request: Request, body):
    """vLLM's X-Request-Id: the header, when sent, is the request id (over the body's)."""
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


def _internal_request(path: str, body: bytes) -> Request:
    """A batch line as the HTTP request its route reads: a JSON POST whose client never
    leaves (the runner cancels the line's task to abort it)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {}

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "client": None, "server": None, "scheme": "http", "http_version": "1.1"}
    return Request(scope, receive)


def _guarded(handler):
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            return error_response(exc, route_path(request.scope))
        except Exception:
            log.exception("unhandled error in %s", route_path(request.scope))
            return error_response(APIError(500, "internal server error"), route_path(request.scope))

    return endpoint


def build_app(ctx: ServingContext, config: FrontendConfig) -> Starlette:
    registry = metrics_registry(ctx.client, ctx.model_name, config.export_engine_metrics)
    admission = Admission(config.max_queued_requests)
    # The checks in serving read the bounds from ctx; the body scan here reads the depth.
    ctx.limits = limits = RequestLimits.from_config(config, ctx.vocab_size)

    async def _decode_body(request: Request, body_type):
        return await _decode(request, body_type, limits.max_json_depth)

    readiness = Readiness(ctx.client, admission)

    async def health(request: Request) -> Response:
        # 503 while draining too, so balancers stop sending before the frontend goes.
        if readiness.ready:
            return Response(status_code=200)
        return Response(status_code=503, headers=readiness.not_ready_headers())

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    def json_response(body) -> Response:
        return Response(_json.encode(body), media_type="application/json")

    def model_card(name: str) -> ModelCard:
        stats = ctx.client.stats
        return ModelCard(id=name, created=ctx.started, root=ctx.model_source,
                         max_model_len=stats.max_model_len if stats else 0)

    def lora_cards() -> list[ModelCard]:
        stats = ctx.client.stats
        return lora_routes.lora_cards(ctx, stats.max_model_len if stats else 0)

    async def models(request: Request) -> Response:
        # One card per served name, as vLLM lists them, then the engines' LoRA adapters.
        return json_response(ModelList([model_card(name) for name in
                                        (ctx.model_name, *ctx.model_aliases)] + lora_cards()))

    async def model(request: Request) -> Response:
        # The client's models.retrieve(); `:path` so a Hub id (org/name) is one model id.
        name = request.path_params["model_id"]
        check_model(ctx, name)
        card = next((c for c in lora_cards() if c.id == name), None)
        return json_response(card or model_card(name))

    async def load(request: Request) -> Response:
        # vLLM's shape, read by vllm-router's least-load policy: requests being answered.
        return JSONResponse({"server_load": admission.in_flight})

    async def chat(request: Request) -> Response:
        body = _with_request_id(request, await _decode_body(request, ChatCompletionRequest))
        return await serving.chat_completion(ctx, request, body)

    async def completions(request: Request) -> Response:
        body = _with_request_id(request, await _decode_body(request, CompletionRequest))
        return await serving.completion(ctx, request, body)

    async def invocations(request: Request) -> Response:
        # SageMaker's one route, routed by the body's shape as vLLM does (the first request
        # type the body fits, chat before completions); the route then decodes it strictly.
        shape = await _decode_body(request, _InvocationShape)
        if _given(shape.messages):
            return await chat(request)
        if _given(shape.prompt):
            return await completions(request)
        raise APIError(400, "Cannot route this /invocations body: send a chat completion "
                            "(with messages) or a completion (with prompt).")

    state = open_store(config.state_store, config.max_stored_responses,
                       config.max_stored_bytes)
    records = ResponseRecords(state, config.responses_ttl_s or None)
    responses = responses_api.Responses(
        records, BackgroundRunner(records),
        ConversationRecords(state, config.max_conversation_items,
                            config.conversation_ttl_s or None),
        keys=frozenset(config.api_keys))

    # Files and batches (frontend.batches): each line goes to the route an interactive
    # request of its endpoint meets (`line_routes`, filled from the route table below).
    line_routes: dict = {}

    async def dispatch(path: str, body: bytes) -> tuple[int, bytes]:
        response = await line_routes[path](_internal_request(path, body))
        return response.status_code, bytes(response.body)

    batch_ttl = config.batch_ttl_s or None
    files, batch_records = FileRecords(state, batch_ttl), BatchRecords(state, batch_ttl)
    pooling = resolve_runner(config.model, config.runner, config.hf_overrides) == "pooling"
    batches = batches_api.Batches(
        files, batch_records,
        BatchRunner(batch_records, files, dispatch, config.max_running_batches,
                    config.max_batch_lines_in_flight),
        batches_api.BatchSettings(
            config.max_batch_file_bytes, config.max_batch_lines, config.max_active_batches,
            ("/v1/embeddings",) if pooling else ("/v1/chat/completions", "/v1/completions")))
    keys = frozenset(config.api_keys)

    def owned(handler):
        """A batch wing handler, given the caller's owner and the shared records."""
        async def endpoint(request: Request) -> Response:
            answer = await handler(request, owner_of(request, keys), batches)
            return answer if isinstance(answer, Response) else json_response(answer)
        return _guarded(endpoint)

    async def batch_create(request: Request, owner: str, b) -> Response:
        return await batches_api.create_batch(
            await _decode_body(request, BatchCreate), owner, b)

    async def messages_batch_create(request: Request, owner: str, b) -> Response:
        return await anthropic_batches.create(
            request, await _decode_body(request, AnthropicBatchCreate), owner, b)

    async def responses_create(request: Request) -> Response:
        body = _with_request_id(request, await _decode_body(request, ResponsesRequest))
        return await responses_api.create(ctx, request, body, responses)

    async def responses_input_tokens(request: Request) -> Response:
        body = await _decode_body(request, InputTokensRequest)
        return json_response(await responses_api.input_tokens(ctx, request, body, responses))

    async def responses_compact(request: Request) -> Response:
        raise APIError(404, "/v1/responses/compact is not supported by this server.")

    async def responses_get(request: Request) -> Response:
        stream, after = responses_api.stream_query(request)
        if stream:  # a background response's events, stored and then live
            return await responses_api.resume_stream(
                ctx, request, responses, request.path_params["response_id"], after)
        return json_response(await responses_api.retrieve(
            ctx, request, responses, request.path_params["response_id"]))

    async def responses_delete(request: Request) -> Response:
        return json_response(await responses_api.delete(
            request, responses, request.path_params["response_id"]))

    async def responses_cancel(request: Request) -> Response:
        return json_response(await responses_api.cancel(
            request, responses, request.path_params["response_id"]))

    async def responses_input_items(request: Request) -> Response:
        return json_response(await responses_api.input_items(
            request, responses, request.path_params["response_id"]))

    async def conversations_create(request: Request) -> Response:
        body = await _decode_body(request, ConversationCreate)
        return json_response(await conversation_api.create(request, body, responses))

    async def conversation_get(request: Request) -> Response:
        return json_response(await conversation_api.retrieve(
            request, responses, request.path_params["conversation_id"]))

    async def conversation_update(request: Request) -> Response:
        body = await _decode_body(request, ConversationUpdate)
        return json_response(await conversation_api.update(
            request, body, responses, request.path_params["conversation_id"]))

    async def conversation_delete(request: Request) -> Response:
        return json_response(await conversation_api.delete(
            request, responses, request.path_params["conversation_id"]))

    async def conversation_items(request: Request) -> Response:
        return json_response(await conversation_api.list_items(
            request, responses, request.path_params["conversation_id"]))

    async def conversation_items_add(request: Request) -> Response:
        body = await _decode_body(request, ItemsCreate)
        return json_response(await conversation_api.add_items(
            request, body, responses, request.path_params["conversation_id"]))

    async def conversation_item_get(request: Request) -> Response:
        return json_response(await conversation_api.retrieve_item(
            request, responses, request.path_params["conversation_id"],
            request.path_params["item_id"]))

    async def conversation_item_delete(request: Request) -> Response:
        return json_response(await conversation_api.delete_item(
            request, responses, request.path_params["conversation_id"],
            request.path_params["item_id"]))

    async def messages(request: Request) -> Response:
        body = await _decode_body(request, MessagesRequest)
        return await anthropic_api.create(ctx, request, body)

    async def messages_count_tokens(request: Request) -> Response:
        body = await _decode_body(request, CountTokensRequest)
        return json_response(await anthropic_api.count_tokens(ctx, body))

    async def tokenize(request: Request) -> Response:
        body = await _decode_body(request, TokenizeRequest)
        result = await serving.tokenize(ctx, body)
        return Response(_json.encode(result), media_type="application/json")

    async def detokenize(request: Request) -> Response:
        body = await _decode_body(request, DetokenizeRequest)
        result = await serving.detokenize(ctx, body)
        return Response(_json.encode(result), media_type="application/json")

    async def metrics(request: Request) -> Response:
        if config.export_engine_metrics and ctx.client.engine_alive:
            await ctx.client.refresh_stats()
        return Response(render(registry), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await ctx.client.start()
        sweep = asyncio.create_task(responses_api.sweep(ctx, responses))
        batch_sweep = asyncio.create_task(batches.runner.sweep())
        try:
            yield
        finally:
            sweep.cancel()
            batch_sweep.cancel()
            await batches.runner.stop()
            await responses.runner.stop()
            await state.close()
            await ctx.client.stop()
            ctx.tokenization.shutdown()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # SageMaker's /health, as vLLM's
        Route("/load", load, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", _guarded(models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _guarded(model), methods=["GET"]),
        Route("/v1/chat/completions", _guarded(chat), methods=["POST"]),
        Route("/v1/completions", _guarded(completions), methods=["POST"]),
        # Literal paths before parameterised ones (req R-2): Starlette answers with the
        # first route whose pattern and method match, and `{response_id}` matches any one
        # path segment, so a parameterised route listed first would take a literal path it
        # shares a method with (`/v1/responses/input_tokens` read as a response id, as would
        # any literal added later beside `{response_id}` or `{batch_id}`).
        Route("/v1/responses", _guarded(responses_create), methods=["POST"]),
        Route("/v1/responses/input_tokens", _guarded(responses_input_tokens), methods=["POST"]),
        Route("/v1/responses/compact", _guarded(responses_compact), methods=["POST"]),
        Route("/v1/responses/{response_id}", _guarded(responses_get), methods=["GET"]),
        Route("/v1/responses/{response_id}", _guarded(responses_delete), methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", _guarded(responses_cancel),
              methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", _guarded(responses_input_items),
              methods=["GET"]),
        Route("/v1/conversations", _guarded(conversations_create), methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", _guarded(conversation_get),
              methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", _guarded(conversation_update),
              methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", _guarded(conversation_delete),
              methods=["DELETE"]),
        Route("/v1/conversations/{conversation_id}/items", _guarded(conversation_items),
              methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items", _guarded(conversation_items_add),
              methods=["POST"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}",
              _guarded(conversation_item_get), methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}",
              _guarded(conversation_item_delete), methods=["DELETE"]),
        Route("/v1/messages", _guarded(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _guarded(messages_count_tokens), methods=["POST"]),
        # Anthropic's Message Batches, over the same batch runner as /v1/batches.
        Route("/v1/messages/batches", owned(messages_batch_create), methods=["POST"]),
        Route("/v1/messages/batches", owned(anthropic_batches.list_batches), methods=["GET"]),
        Route("/v1/messages/batches/{batch_id}/results", owned(anthropic_batches.results),
              methods=["GET"]),
        Route("/v1/messages/batches/{batch_id}/cancel", owned(anthropic_batches.cancel),
              methods=["POST"]),
        Route("/v1/messages/batches/{batch_id}", owned(anthropic_batches.retrieve),
              methods=["GET"]),
        Route("/v1/messages/batches/{batch_id}", owned(anthropic_batches.delete),
              methods=["DELETE"]),
        # OpenAI's Files and Batch APIs (frontend.batches).
        Route("/v1/files", owned(batches_api.upload_file), methods=["POST"]),
        Route("/v1/files", owned(batches_api.list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", owned(batches_api.get_file), methods=["GET"]),
        Route("/v1/files/{file_id}", owned(batches_api.delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", owned(batches_api.file_content),
              methods=["GET"]),
        Route("/v1/batches", owned(batch_create), methods=["POST"]),
        Route("/v1/batches", owned(batches_api.list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", owned(batches_api.get_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", owned(batches_api.cancel_batch),
              methods=["POST"]),
        Route("/invocations", _guarded(invocations), methods=["POST"]),
        Route("/tokenize", _guarded(tokenize), methods=["POST"]),
        Route("/detokenize", _guarded(detokenize), methods=["POST"]),
        *embeddings_api.routes(ctx, config, _decode_body, _guarded),  # pooling models
        *scoring_api.routes(ctx, config, _decode_body, _guarded),  # cross-encoders
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi.endpoint(ctx.model_name, VERSION), methods=["GET"]),
    ]
    line_routes.update({route.path: route.endpoint for route in routes
                        if route.path in batches.settings.endpoints + ("/v1/messages",)
                        and "POST" in (route.methods or ())})
    if config.allow_runtime_lora_updating:  # vLLM's run-time adapter routes (issue 36)
        load_lora, unload_lora = lora_routes.routes(ctx, _decode_body)
        routes += [Route("/v1/load_lora_adapter", _guarded(load_lora), methods=["POST"]),
                   Route("/v1/unload_lora_adapter", _guarded(unload_lora), methods=["POST"])]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error},
        middleware=_middleware(config, admission),
    )
    app.state.admission = admission  # the drain on SIGTERM (frontend.http.server) flips it
    app.state.readiness = readiness  # frontend.http.server announces it
    return app


def _middleware(config: FrontendConfig, admission: Admission) -> list[Middleware]:
    """Outermost first: CORS answers preflights and decorates even 401s (browsers must see
    them); unauthenticated requests are refused before their bodies are read or queued."""
    stack = [Middleware(RequestIdMiddleware)]
    if config.allowed_origins:
        stack.append(Middleware(
            CORSMiddleware, allow_origins=config.allowed_origins,
            allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
            allow_credentials=config.allow_credentials,
        ))
    if config.api_keys:
        stack.append(Middleware(AuthMiddleware, keys=config.api_keys))
    stack.append(Middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes))
    stack.append(Middleware(AdmissionMiddleware, admission=admission))
    return stack


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown path 404, wrong method 405) in the one error shape."""
    response = error_response(APIError(exc.status_code, exc.detail or "request failed"),
                              route_path(request.scope))
    response.headers.update(exc.headers or {})
    return response
