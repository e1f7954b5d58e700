"""The web UI's routes (issue 55): the playground at `/`, the dashboard at `/dashboard` and
their files under `/static/`, from `frontend.web.assets`. Off with --disable-web-ui."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from frontend.base.errors import route_path
from frontend.http.routes.context import AppContext
from frontend.web.assets import CACHE_CONTROL, CSP, PAGES, STATIC_PREFIX, Asset, load_assets


def routes(app: AppContext) -> list[Route]:
    if app.config.disable_web_ui:
        return []
    assets = load_assets(needs_key=bool(app.config.api_keys))

    async def serve(request: Request) -> Response:
        asset = assets.get(route_path(request.scope))
        if asset is None:
            raise HTTPException(404, "no such file")
        return _response(request, asset)

    # Not API: left out of /openapi.json (include_in_schema) and of Schemathesis' runs.
    return [
        *(Route(path, serve, methods=["GET"], include_in_schema=False) for path in PAGES),
        Route(STATIC_PREFIX + "{name}", serve, methods=["GET"], include_in_schema=False),
    ]


def _response(request: Request, asset: Asset) -> Response:
    headers = {"Cache-Control": CACHE_CONTROL, "ETag": asset.etag,
               "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
    if asset.content_type.startswith("text/html"):
        headers["Content-Security-Policy"] = CSP
    if asset.etag in _tags(request.headers.get("if-none-match", "")):
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.content_type, headers=headers)


def _tags(header: str) -> set[str]:
    """If-None-Match's entity tags, weak ones (W/"...") compared as strong, as GETs may."""
    return {tag.strip().removeprefix("W/") for tag in header.split(",")} - {""}
