"""The operator's routes: health and readiness, load, version, /metrics and /openapi.json,
the engines as this frontend sees them (/v1/engines, behind --api-key), and TensorRT-LLM's
(frontend.http.engine_ops)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend.engine_client.engine_list import engine_list
from frontend.http import openapi
from frontend.http.engine_ops import EngineOps
from frontend.http.metrics import render
from frontend.http.routes.context import AppContext, guarded, json_response
from shared.runner_config import resolve_runner

VERSION = "0.1.0"


def routes(app: AppContext) -> list[Route]:
    async def health(request: Request) -> Response:
        # 503 while draining too, so balancers stop sending before the frontend goes.
        if app.readiness.ready:
            return Response(status_code=200)
        headers = app.readiness.not_ready_headers()
        refusals = app.ctx.client.refusals
        if refusals and not app.readiness.admission.draining:  # an engine answers: why not it
            return JSONResponse({"status": "unhealthy", "reason": refusals[0]},
                                status_code=503, headers=headers)
        return Response(status_code=503, headers=headers)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def load(request: Request) -> Response:
        # vLLM's shape, read by vllm-router's least-load policy: requests being answered.
        return JSONResponse({"server_load": app.admission.in_flight})

    async def metrics(request: Request) -> Response:
        if app.config.export_engine_metrics and app.ctx.client.engine_alive:
            await app.ctx.client.refresh_stats()
        return Response(render(app.metrics), media_type="text/plain; version=0.0.4")

    async def engines(request: Request) -> Response:
        # llama-server's /slots, per engine: not in OPEN_PATHS, so behind --api-key.
        return json_response(engine_list(app.ctx.client))

    return [
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # SageMaker's /health, as vLLM's
        Route("/load", load, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi.endpoint(app.ctx.model_name, VERSION), methods=["GET"]),
        Route("/v1/engines", guarded(engines), methods=["GET"]),
        *_trtllm_routes(app),
    ]


def _trtllm_routes(app: AppContext) -> list[Route]:
    """TensorRT-LLM's operator routes (seed 000)."""
    ops = EngineOps(app, VERSION)
    config = app.config
    pooling = resolve_runner(config.model, config.runner, config.hf_overrides) == "pooling"
    # A pooling model generates nothing: no generation to probe (as trtllm-serve's encoder).
    probe = [] if pooling else [Route("/health_generate", guarded(ops.health_generate),
                                      methods=["GET"])]
    return [
        *probe,
        Route("/server_info", guarded(ops.server_info), methods=["GET"]),
        Route("/steady_clock_offset", guarded(ops.get_clock), methods=["GET"]),
        Route("/steady_clock_offset", guarded(ops.set_clock), methods=["POST"]),
        Route("/start_profile", guarded(ops.start_profile), methods=["POST"]),
        Route("/stop_profile", guarded(ops.stop_profile), methods=["POST"]),
        Route("/energy_metrics", guarded(ops.energy_metrics), methods=["GET"]),
        Route("/reset_prefix_cache", guarded(ops.reset_prefix_cache), methods=["POST"]),
        Route("/kv_cache_events", guarded(ops.kv_cache_events), methods=["POST"]),
    ]
