"""API keys (--api-key, SLUICE_API_KEY) as ASGI middleware.

A key comes as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic
clients). Probes and scrapes (`frontend.http.limits.OPEN_PATHS`: `/health`, `/ping`, `/load`,
`/metrics`, `/version`, `/openapi.json`) stay open, so orchestrators, routers and Prometheus
need no secret; so do the web UI's pages and files (`frontend.web.assets.is_web_path`), which
hold no data: they ask the user for the key and send it with their API calls.
"""

from __future__ import annotations

import hmac

from frontend.base.errors import APIError, route_path
from frontend.http.limits import OPEN_PATHS, reject
from frontend.web.assets import is_web_path


class AuthMiddleware:
    def __init__(self, app, keys: list[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]

    async def __call__(self, scope, receive, send) -> None:
        path = route_path(scope)
        if (scope["type"] != "http" or path in OPEN_PATHS or is_web_path(path)
                or self._allowed(scope)):
            return await self.app(scope, receive, send)
        error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer KEY' "
                              "or 'x-api-key: KEY'.")
        await reject(scope, receive, send, error, "unauthorized",
                     {"WWW-Authenticate": "Bearer"})

    def _allowed(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                presented = value[7:].strip()
            elif name == b"x-api-key":
                presented = value.strip()
            else:
                continue
            # Compare with every key, in constant time, so timing reveals nothing.
            if any([hmac.compare_digest(presented, key) for key in self.keys]):
                return True
        return False
