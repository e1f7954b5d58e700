"""A frontend refuses an engine that serves another model or loaded another tokenizer than
the one it renders for (the engine's heartbeat carries both): one log line, no request
goes there, and /health is a 503 saying why. Two frontends over the session's engine."""

import httpx
import pytest

from shared.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests.servers import Frontend, wait_until
from tests.tiny_mistral import vocab_size, write_tekken


@pytest.fixture(scope="module")
def refused(shared_engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("consistency")
    (tmp / "tok").mkdir()
    write_tekken(str(tmp / "tok"))  # a Mistral tokenizer (byte-level, as llguidance needs)
    (tmp / "tok" / "config.json").write_text(
        f'{{"model_type": "mistral", "vocab_size": {vocab_size()}}}')
    frontends = [Frontend(str(tmp), shared_engine, "other-tokenizer", "--tokenizer",
                          str(tmp / "tok"), wait=False),
                 Frontend(str(tmp), shared_engine, "other-model", "--served-model-name",
                          "someone-else", wait=False)]
    try:
        for f in frontends:
            wait_until(lambda f=f: _refusing(f), 120, f"{f.base_url} refusing the engine")
        yield frontends
    finally:
        for f in frontends:
            f.stop()


def _refusing(frontend) -> bool:
    if frontend.proc.popen.poll() is not None:
        raise RuntimeError(f"the frontend exited:\n{frontend.proc.log()[-3000:]}")
    return _health(frontend).status_code == 503 and bool(_reason(frontend))


def _health(frontend) -> httpx.Response:
    try:
        return httpx.get(f"{frontend.base_url}/health", timeout=2)
    except httpx.HTTPError:
        return httpx.Response(599)


def _reason(frontend) -> str:
    response = _health(frontend)
    if response.headers.get("content-type") != "application/json":
        return ""
    return response.json()["reason"]


def test_another_tokenizer_is_refused_with_the_reason(refused, shared_engine):
    frontend = refused[0]
    reason = _reason(frontend)
    engine_side = tokenizer_fingerprint(load_tokenizer("default"))  # as the engine computes it
    assert "another tokenizer" in reason and engine_side in reason
    tokenizer = frontend.proc.popen.args[frontend.proc.popen.args.index("--tokenizer") + 1]
    assert tokenizer_fingerprint(load_tokenizer(tokenizer)) in reason
    r = httpx.post(f"{frontend.base_url}/v1/completions",
                   json={"prompt": "hello", "max_tokens": 1}, timeout=30)
    assert r.status_code == 503  # nothing goes to that engine
    lines = [line for line in frontend.proc.log().splitlines() if "refusing engine" in line]
    assert len(lines) == 1 and "--tokenizer-mode" in lines[0]


def test_another_model_is_refused_and_a_matching_frontend_serves(refused, shared_engine):
    reason = _reason(refused[1])
    assert "serves the model" in reason and "'someone-else'" in reason
    default = shared_engine.default_frontend.base_url  # same model and tokenizer: served
    assert httpx.get(f"{default}/health", timeout=5).status_code == 200
    r = httpx.post(f"{default}/v1/completions", json={"prompt": "hello", "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200
