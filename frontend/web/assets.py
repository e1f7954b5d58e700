"""The web UI's files, read once from the package, and the headers they are served with.

Every file is named in `load_assets`' table and served from memory, so no request path ever
reaches the file system. The pages are the only HTML; their scripts and styles are files of
their own, which is what lets the Content-Security-Policy forbid inline code and every other
origin: a page can load, run and call nothing but this server.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

HERE = Path(__file__).parent
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
STATIC_PREFIX = "/static/"
CONTENT_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".svg": "image/svg+xml", ".html": "text/html; charset=utf-8"}
# Images the user attaches are read as data: URLs, hence img-src data:; nothing else but
# 'self' anywhere, and no inline script or style at all.
CSP = ("default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'; object-src 'none'")
# Files keep their names (no build step hashes them), so browsers revalidate each use: a
# 304 from the ETag costs a round trip, and a new release is never served stale.
CACHE_CONTROL = "no-cache"
AUTH_MARK = b'data-auth=""'


class Asset(msgspec.Struct, frozen=True):
    body: bytes
    content_type: str
    etag: str


def is_web_path(path: str) -> bool:
    """The pages and their files: served without an API key (the API calls carry it)."""
    return path in PAGES or path.startswith(STATIC_PREFIX)


def load_assets(needs_key: bool) -> dict[str, Asset]:
    """URL path -> file, for the pages and every file in static/. `needs_key` marks the
    pages so they ask for the key before their first API call (not after a 401)."""
    assets = {}
    for path, name in PAGES.items():
        body = (HERE / "pages" / name).read_bytes()
        if needs_key:
            body = body.replace(AUTH_MARK, b'data-auth="key"', 1)
        assets[path] = _asset(body, ".html")
    for file in sorted((HERE / "static").iterdir()):
        if file.suffix in CONTENT_TYPES:
            assets[STATIC_PREFIX + file.name] = _asset(file.read_bytes(), file.suffix)
    return assets


def _asset(body: bytes, suffix: str) -> Asset:
    digest = hashlib.sha256(body).hexdigest()[:20]
    return Asset(body, CONTENT_TYPES[suffix], f'"{digest}"')
