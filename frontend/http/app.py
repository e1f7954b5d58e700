"""The ASGI app: it opens the records the routes share, assembles each face's routes
(`frontend/http/routes/`) into one table, and wraps it in the middleware stack."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.base.errors import APIError, error_response, route_path
from frontend.batches import api as batches_api
from frontend.batches.records import BatchRecords, FileRecords
from frontend.batches.runner import BatchRunner, line_owner
from frontend.embeddings import embeddings as embeddings_api
from frontend.embeddings import scoring as scoring_api
from frontend.http import key_setup
from frontend.http.auth import AuthMiddleware
from frontend.http.limits import Admission, AdmissionMiddleware, BodyLimitMiddleware
from frontend.http.metrics import metrics_registry
from frontend.http.readiness import Readiness
from frontend.http.request_id import RequestIdMiddleware
from frontend.http.routes import anthropic, batches, openai, ops, responses, web
from frontend.http.routes.context import AppContext, guarded
from frontend.input.input_bounds import RequestLimits
from frontend.pipeline.serving_context import ServingContext
from frontend.pipeline.tracing import TracingMiddleware, batch_line_span
from frontend.responses import background_runs
from frontend.responses.background import BackgroundRunner
from frontend.responses.conversations import ConversationRecords
from frontend.responses.shared import Responses
from frontend.responses.stored import ResponseRecords
from frontend.state.store import StateStore, open_store
from shared.config import FrontendConfig
from shared.log_format import close_request, open_request
from shared.runner_config import resolve_runner
from shared.tracing import tracing


def build_app(ctx: ServingContext, config: FrontendConfig) -> Starlette:
    admission = Admission(config.max_queued_requests)
    # The checks in serving read the bounds from ctx; the body decoder reads the depth.
    ctx.limits = limits = RequestLimits.from_config(config, ctx.vocab_size)
    state = open_store(config.state_store, config.max_stored_responses,
                       config.max_stored_bytes)
    keys = key_setup.open_keys(config, state)  # --api-keys-file
    # Each batch line goes to the route an interactive request of its endpoint meets,
    # filled from the route table once it is built.
    line_routes: dict = {}
    app = AppContext(
        ctx=ctx, config=config, limits=limits, admission=admission,
        readiness=Readiness(ctx.client, admission),
        metrics=metrics_registry(ctx.client, ctx.model_name, config.export_engine_metrics),
        responses=_responses(state, config),
        batches=_batches(state, config, line_routes, keys),
        keys=frozenset(config.api_keys))
    routes = _routes(app)
    line_routes.update({route.path: route.endpoint for route in routes
                        if route.path in app.batches.settings.endpoints + ("/v1/messages",)
                        and "POST" in (route.methods or ())})
    starlette = Starlette(
        routes=routes, lifespan=_lifespan(app, state, keys),
        exception_handlers={HTTPException: _http_error},
        middleware=_middleware(config, admission, keys),
    )
    starlette.state.admission = admission  # the drain on SIGTERM (frontend.http.server) flips it
    starlette.state.readiness = app.readiness  # frontend.http.server announces it
    return starlette


def _routes(app: AppContext) -> list[Route]:
    """Every face's routes. Within a face, literal paths come before parameterised ones."""
    ctx, config, decode = app.ctx, app.config, app.decode
    return [
        *ops.routes(app),
        *openai.routes(app),
        *responses.routes(app),
        *anthropic.routes(app),
        *batches.routes(app),
        *embeddings_api.routes(ctx, config, decode, guarded),  # pooling models
        *scoring_api.routes(ctx, config, decode, guarded),  # cross-encoders
        *web.routes(app),  # the playground and dashboard (off with --disable-web-ui)
    ]


def _responses(state: StateStore, config: FrontendConfig) -> Responses:
    records = ResponseRecords(state, config.responses_ttl_s or None)
    return Responses(
        records, BackgroundRunner(records),
        ConversationRecords(state, config.max_conversation_items,
                            config.conversation_ttl_s or None),
        keys=frozenset(config.api_keys))


def _batches(state: StateStore, config: FrontendConfig, line_routes: dict,
             keys: key_setup.KeyService | None) -> batches_api.Batches:
    """Files and batches (frontend.batches), whose lines run through `line_routes`, each
    within its key's limits where --api-keys-file gives it some, each its own trace, its
    log lines carrying its own request id as HTTP ones do."""
    async def run(path: str, body: bytes) -> tuple[int, bytes]:
        token = open_request()
        try:
            with batch_line_span(tracing(), path) as status:
                response = await line_routes[path](_internal_request(path, body))
                if status is not None:
                    status[0] = response.status_code
        finally:
            close_request(token)
        return response.status_code, bytes(response.body)

    async def dispatch(path: str, body: bytes) -> tuple[int, bytes]:
        return await key_setup.batch_line(keys, line_owner.get(), path, body,
                                          lambda b: run(path, b))

    batch_ttl = config.batch_ttl_s or None
    files, batch_records = FileRecords(state, batch_ttl), BatchRecords(state, batch_ttl)
    pooling = resolve_runner(config.model, config.runner, config.hf_overrides) == "pooling"
    return batches_api.Batches(
        files, batch_records,
        BatchRunner(batch_records, files, dispatch, config.max_running_batches,
                    config.max_batch_lines_in_flight),
        batches_api.BatchSettings(
            config.max_batch_file_bytes, config.max_batch_lines, config.max_active_batches,
            ("/v1/embeddings",) if pooling else ("/v1/chat/completions", "/v1/completions")))


def _lifespan(app: AppContext, state: StateStore, keys: key_setup.KeyService | None):
    """The engine client and the sweeps run while the app serves; the stores close after."""
    @contextlib.asynccontextmanager
    async def lifespan(_starlette):
        await app.ctx.client.start()
        sweep = asyncio.create_task(background_runs.sweep(app.ctx, app.responses))
        batch_sweep = asyncio.create_task(app.batches.runner.sweep())
        try:
            async with key_setup.watching(keys):
                yield
        finally:
            sweep.cancel()
            batch_sweep.cancel()
            await app.batches.runner.stop()
            await app.responses.runner.stop()
            await state.close()
            await app.ctx.client.stop()
            app.ctx.tokenization.shutdown()

    return lifespan


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


def _middleware(config: FrontendConfig, admission: Admission,
                keys: key_setup.KeyService | None) -> list[Middleware]:
    """Outermost first: CORS answers preflights and decorates even 401s (browsers must see
    them); unauthenticated requests are refused before their bodies are read or queued."""
    stack = [Middleware(RequestIdMiddleware)]
    if tracing() is not None:  # outermost: refusals are traced too
        stack.insert(0, Middleware(TracingMiddleware, sink=tracing()))
    if config.allowed_origins:
        stack.append(Middleware(
            CORSMiddleware, allow_origins=config.allowed_origins,
            allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
            allow_credentials=config.allow_credentials,
        ))
    key_auth, key_limits = key_setup.middleware(keys) if keys else (None, None)
    if key_auth is not None:  # the file's keys and --api-key's, with their limits
        stack.append(key_auth)
    elif config.api_keys:
        stack.append(Middleware(AuthMiddleware, keys=config.api_keys))
    stack.append(Middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes))
    if key_limits is not None:
        stack.append(key_limits)
    stack.append(Middleware(AdmissionMiddleware, admission=admission))
    return stack


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown path 404, wrong method 405) in the one error shape."""
    response = error_response(APIError(exc.status_code, exc.detail or "request failed"),
                              route_path(request.scope))
    response.headers.update(exc.headers or {})
    return response
