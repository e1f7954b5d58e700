"""The operator's routes: health and readiness, load, version, /metrics and /openapi.json, and
the engines as this frontend sees them (/v1/engines, behind --api-key)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from frontend.engine_client.engine_list import engine_list
from frontend.http import openapi
from frontend.http.metrics import render
from frontend.http.routes.context import AppContext, guarded, json_response

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
    ]
