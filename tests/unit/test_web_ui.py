"""The web UI's routes without a browser (issue 55): what `/`, `/dashboard` and `/static/`
answer, with which headers, beside --api-key and under --disable-web-ui; the flag and its
forwarding by `serve`; and the rules the files keep (relative URLs, no innerHTML, every
import and reference resolvable, all of them package data). The browser test is
tests/integration/test_web_ui.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from frontend.http.app import build_app
from frontend.web import assets
from shared.config import FrontendConfig
from sluice import cli

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "frontend" / "web"


def _client(**config) -> TestClient:
    ctx = SimpleNamespace(client=SimpleNamespace(engine_alive=False, stats=None),
                          model_name="m", vocab_size=49152)
    return TestClient(build_app(ctx, FrontendConfig(
        model="m", served_model_name="m", engine_address="tcp://x:1", **config)))


@pytest.fixture(scope="module")
def open_client():
    return _client()


def test_pages_and_files_with_their_types_and_headers(open_client):
    for path, kind in (("/", "text/html"), ("/dashboard", "text/html"),
                       ("/static/playground.js", "text/javascript"),
                       ("/static/style.css", "text/css"), ("/static/icon.svg", "image/svg+xml")):
        response = open_client.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-type"].startswith(kind), path
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["etag"].startswith('"')
        # The policy that keeps every request on this origin and no inline code running.
        has_csp = "content-security-policy" in response.headers
        assert has_csp == kind.startswith("text/html"), path
    csp = open_client.get("/").headers["content-security-policy"]
    assert "default-src 'self'" in csp and "unsafe-inline" not in csp
    assert b'data-auth=""' in open_client.get("/").content  # no key asked for


def test_revalidation_answers_304_for_the_current_tag_only(open_client):
    tag = open_client.get("/static/api.js").headers["etag"]
    for header in (tag, f"W/{tag}", f'"other", {tag}'):
        response = open_client.get("/static/api.js", headers={"If-None-Match": header})
        assert response.status_code == 304 and response.content == b"", header
        assert response.headers["etag"] == tag
    for header in ('"other"', "", ","):
        assert open_client.get("/static/api.js",
                               headers={"If-None-Match": header}).status_code == 200
    head = open_client.head("/dashboard")
    assert head.status_code == 200 and head.content == b""


def test_unknown_files_and_methods_are_the_usual_errors(open_client):
    for path in ("/static/nope.js", "/static/", "/static/..%2Fpages%2Findex.html",
                 "/static/../pages/index.html", "/static/index.html", "/static/api.js/x"):
        response = open_client.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["message"], path  # the one error shape
    assert open_client.post("/", json={}).status_code == 405


def test_behind_a_key_the_pages_are_open_and_ask_for_it():
    client = _client(api_keys=["sk-1"])
    page = client.get("/")
    assert page.status_code == 200 and b'data-auth="key"' in page.content
    assert client.get("/dashboard").status_code == 200
    assert client.get("/static/dashboard.js").status_code == 200
    assert client.get("/v1/models").status_code == 401  # the API still wants the key
    assert client.get("/static/nope.js").status_code == 404  # not 401: nothing is there


def test_disable_web_ui_serves_none_of_it():
    client = _client(disable_web_ui=True)
    for path in ("/", "/dashboard", "/static/api.js"):
        assert client.get(path).status_code == 404, path


def _frontend_args(*argv: str):
    return cli.build_parser().parse_args(["frontend", *argv])


def test_the_flag_reaches_the_config_and_serve_forwards_it(monkeypatch, capsys):
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    config = cli.frontend_config
    assert config(_frontend_args(), "tcp://127.0.0.1:1", None).disable_web_ui is False
    on = config(_frontend_args("--disable-web-ui"), "tcp://127.0.0.1:1", None)
    assert on.disable_web_ui is True
    with pytest.raises(SystemExit) as exited:  # a switch: it takes no value
        _frontend_args("--disable-web-ui=yes")
    assert exited.value.code == 2 and "--disable-web-ui" in capsys.readouterr().err
    def forwarded(*argv: str) -> list[str]:
        return cli._frontend_http_argv(cli.build_parser().parse_args(["serve", *argv]))

    assert "--disable-web-ui" in forwarded("--disable-web-ui")
    assert "--disable-web-ui" not in forwarded()


def _files(folder: str) -> list[Path]:
    return sorted((WEB / folder).iterdir())


def test_the_files_keep_the_pages_rules():
    scripts = {p.name: p.read_text() for p in _files("static") if p.suffix == ".js"}
    for name, text in scripts.items():
        # Model output and storage become DOM nodes (markdown.js), never parsed HTML.
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(",
                             text), name
        for imported in re.findall(r'from "\./([\w.-]+)"', text):
            assert imported in scripts, f"{name} imports {imported}"
        # Relative URLs only, so the pages work under --root-path.
        assert not re.search(r'api\("/|fetch\("/|https?://', text), name
    for page in _files("pages"):
        text = page.read_text()
        assert assets.AUTH_MARK.decode() in text, page.name
        for ref in re.findall(r'(?:href|src)="([^"]+)"', text):
            assert not ref.startswith(("/", "http:", "https:")), f"{page.name}: {ref}"
            if ref.startswith("static/"):
                assert (WEB / ref).is_file(), f"{page.name}: {ref}"
        assert "<script>" not in text and "style=" not in text, page.name  # CSP: none inline


def test_every_file_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["frontend.web"]
    for file in [*_files("pages"), *_files("static")]:
        relative = file.relative_to(WEB)
        assert any(relative.match(g) for g in globs), relative
    assert set(assets.load_assets(False)) == {"/", "/dashboard", *(
        f"/static/{p.name}" for p in _files("static"))}
