"""A vLLM launch line, changed only in the binary's name (issue 19): a Hub id from the local
cache as the positional model, flags from a `--config` YAML in vLLM's underscore spelling, a
no-op vLLM flag, two served names, TLS; the official client works against it."""

from __future__ import annotations

import os
import ssl
import subprocess
import time

import httpx
import openai
import pytest

from shared.model_source import default_model_path
from shared.transport import free_tcp_port
from tests.servers import STARTUP_TIMEOUT_S, Proc

pytestmark = pytest.mark.slow

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
# Greets by a template variable, so --default-chat-template-kwargs shows in prompt_tokens.
# It reads reasoning_effort and documents, and loops over content parts (so it gets them).
TEMPLATE = ("{{ greeting | default('') }}"
            "{% if reasoning_effort %}Think {{ reasoning_effort }} hard.\n{% endif %}"
            "{% for d in documents or [] %}Document: {{ d.text }}\n{% endfor %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% for p in m.content %}{{ p.text }}{% endfor %}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n")


def _hub_cache(root) -> str:
    """The bundled GGUF in the Hub cache's layout, linked as the hub links blobs."""
    repo = root / ("models--" + REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    os.symlink(default_model_path(), snapshot / "smollm2-135m-instruct-q4_1.gguf")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c" * 40)
    return str(root)


def _certificate(tmp_path) -> tuple[str, str]:
    key, cert = str(tmp_path / "key.pem"), str(tmp_path / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def _wait_healthy(url: str, proc: Proc, **client) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"sluice exited early:\n{proc.log()[-4000:]}")
        try:
            with httpx.Client(**client) as http:
                if http.get(url, timeout=2).status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy:\n{proc.log()[-3000:]}")


@pytest.fixture(scope="module")
def vllm_style(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_style")
    key, cert = _certificate(tmp)
    config = tmp / "config.yaml"
    config.write_text(
        f"download_dir: {_hub_cache(tmp / 'hub')}\n"
        "max_model_len: 2048\nmax_num_seqs: 8\n"
        "served_model_name: [smol, smol-alias]\n"
        "max_logprobs: 5\n"
        f"ssl_keyfile: {key}\nssl_certfile: {cert}\n"
        "enable_log_requests: true\nenable_log_outputs: true\n"
        "default_chat_template_kwargs: {greeting: 'Hello there, assistant. '}\n")
    (tmp / "template.jinja").write_text(TEMPLATE)
    port = free_tcp_port()
    proc = Proc(["serve", REPO_ID, "--config", str(config), "--port", str(port),
                 "--trust-remote-code", "--max_num_batched_tokens", "256",
                 "--chat_template", str(tmp / "template.jinja")],
                str(tmp / "serve.log"))
    try:
        _wait_healthy(f"https://127.0.0.1:{port}/health", proc, verify=_trusting(cert))
        yield f"https://127.0.0.1:{port}", cert, proc
    finally:
        proc.stop()


def _client(base_url: str, cert: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none",
                         http_client=httpx.Client(verify=_trusting(cert)), max_retries=0)


def _trusting(cert: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert)


def test_the_official_client_works_over_tls(vllm_style):
    base_url, cert, proc = vllm_style
    client = _client(base_url, cert)
    assert [m.id for m in client.models.list().data] == ["smol", "smol-alias"]
    assert client.models.retrieve("smol-alias").id == "smol-alias"
    answer = client.chat.completions.create(
        model="smol-alias", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
        temperature=0)
    assert answer.model == "smol"  # responses carry the first served name
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content
    assert "--trust-remote-code changes nothing here" in proc.log()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user",
                                                                 "content": "x"}])


def test_plain_http_is_refused_on_a_tls_port(vllm_style):
    base_url, _, _ = vllm_style
    with pytest.raises(httpx.HTTPError):
        httpx.get(base_url.replace("https://", "http://") + "/health", timeout=5)


def test_max_logprobs_holds_requests_to_the_flag(vllm_style):
    client = _client(*vllm_style[:2])
    messages = [{"role": "user", "content": "Say hi"}]
    answer = client.chat.completions.create(model="smol", messages=messages, max_tokens=2,
                                            logprobs=True, top_logprobs=5)
    assert len(answer.choices[0].logprobs.content[0].top_logprobs) == 5
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.chat.completions.create(model="smol", messages=messages, max_tokens=2,
                                       logprobs=True, top_logprobs=6)
    with pytest.raises(openai.BadRequestError, match="--max-logprobs"):
        client.completions.create(model="smol", prompt="Hi", max_tokens=2, logprobs=6)


def test_default_chat_template_kwargs_sit_under_the_requests(vllm_style):
    client = _client(*vllm_style[:2])
    messages = [{"role": "user", "content": "Say hi"}]

    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model="smol", messages=messages, max_tokens=1,
                                              **extra).usage.prompt_tokens

    with_default = prompt_tokens()
    without = prompt_tokens(extra_body={"chat_template_kwargs": {"greeting": ""}})
    assert with_default > without  # the server's greeting was rendered; the request's won


def test_requests_and_outputs_are_logged(vllm_style):
    client = _client(*vllm_style[:2])
    answer = client.completions.create(model="smol", prompt="The capital of France is",
                                       max_tokens=4, temperature=0)
    log = vllm_style[2].log()
    request_line = next(line for line in log.splitlines() if "sluice.requests: request"
                        in line and f'"{answer.id}' in line)
    assert "prompt_tokens=" in request_line and '"max_tokens": 4' in request_line
    output_line = next(line for line in log.splitlines() if "sluice.requests: output"
                       in line and f'"{answer.id}' in line)
    assert "finish_reason=\"length\"" in output_line and "output_tokens=4" in output_line


def test_a_unix_socket_and_a_root_path(shared_engine, tmp_path):
    """--uds instead of host:port; under --root-path (a proxy in front strips the prefix)
    routes, the open paths and the API key behave as without it. Every flag here is the
    frontend's, so a frontend over the session's engine serves it (that `serve` forwards
    them: test_vllm_command_line)."""
    path = str(tmp_path / "sluice.sock")
    proc = Proc(["frontend", "--engine-address", shared_engine.address, "--uds", path,
                 "--root-path", "/llm", "--api-key", "k", "--response-role", "helper"],
                str(tmp_path / "frontend.log"))
    transport = httpx.HTTPTransport(uds=path)
    try:
        _wait_healthy("http://sluice/health", proc, transport=transport)
        with httpx.Client(transport=transport, base_url="http://sluice") as http:
            assert http.get("/v1/models").status_code == 401
            key = {"Authorization": "Bearer k"}
            assert http.get("/v1/models", headers=key).json()["data"]
            answer = http.post("/v1/completions", headers=key,
                               json={"prompt": "Hi", "max_tokens": 2}).json()
            assert answer["usage"]["completion_tokens"] == 2
            _check_response_role(http, key)
            # Errors keep each API's shape: the Messages API's under the prefix too.
            error = http.post("/v1/messages", headers=key, json={"model": "x"}).json()
            assert error["type"] == "error"
            assert http.get("/metrics").status_code == 200  # open, no key
    finally:
        proc.stop()


def _check_response_role(http: httpx.Client, key: dict) -> None:
    """--response-role names answers to a generation prompt; a continued message keeps its
    own role, as vLLM."""
    user = [{"role": "user", "content": "Hi"}]
    answer = http.post("/v1/chat/completions", headers=key,
                       json={"messages": user, "max_tokens": 2}).json()
    assert answer["choices"][0]["message"]["role"] == "helper"
    stream = http.post("/v1/chat/completions", headers=key,
                       json={"messages": user, "max_tokens": 2, "stream": True}).text
    assert '"delta":{"role":"helper"}' in stream.replace(" ", "")
    continued = http.post("/v1/chat/completions", headers=key, json={
        "messages": [*user, {"role": "assistant", "content": "Hello"}], "max_tokens": 2,
        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert continued["choices"][0]["message"]["role"] == "assistant"


def test_template_inputs_reach_the_template(vllm_style):
    """Issue 17 item 18: reasoning_effort and documents reach the template, and a template
    that loops over a message's content gets the parts, not one joined string."""
    client = _client(*vllm_style[:2])

    def prompt_tokens(messages, **extra) -> int:
        return client.chat.completions.create(model="smol", messages=messages, max_tokens=1,
                                              **extra).usage.prompt_tokens

    hi = [{"role": "user", "content": "Say hi"}]
    plain = prompt_tokens(hi)
    assert prompt_tokens(hi, reasoning_effort="low") > plain
    assert prompt_tokens(hi, extra_body={"documents": [{"text": "Paris is in France."}]}) > plain
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"},
                                          {"type": "text", "text": " hi"}]}]
    assert prompt_tokens(parts) == plain  # "Say" + " hi", not "Say\n hi"
    with pytest.raises(openai.BadRequestError, match="documents"):
        prompt_tokens(hi, extra_body={"documents": "not a list"})
