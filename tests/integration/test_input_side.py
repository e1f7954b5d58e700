"""The input side through real processes (req T-*, L-4): budgets, truncation, templates,
the render timeout, and what /metrics and the request log show."""

import threading
import time

import httpx
import pytest

from tests.servers import Stack

SHORT_LEN = 256  # --max-model-len of this module's own stack
TIMEOUT_S = 2  # its --render-timeout
# ChatML like SmolLM2's, plus a switch that makes it render for hours.
TEMPLATE = """\
{%- if hang is defined and hang -%}
{%- for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor -%}
{%- endif -%}
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""
HI = [{"role": "user", "content": "Say hi."}]
LONG_PROMPT = "word " * 600  # ~600 tokens: over SHORT_LEN, far under its character ceiling


# The tests on `short` need a `serve` of their own (a short context is the engine's): ~15 s
# to start, so they run in `make test`; the fast tier keeps the ones on the session stack.
SHORT_STACK = pytest.mark.slow


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """A stack with a short context, our own template (from a file), a short render timeout,
    one tokenizer thread (so a stuck one would block everything), request templates on, and
    the per-request log lines (off unless asked for)."""
    tmp = tmp_path_factory.mktemp("input_side")
    template = tmp / "chatml.jinja"
    template.write_text(TEMPLATE)
    s = Stack(str(tmp), "--max-model-len", str(SHORT_LEN), "--chat-template", str(template),
              "--render-timeout", str(TIMEOUT_S), "--trust-request-chat-template",
              "--tokenizer-threads", "1", "--enable-log-requests", "--threads", "1")
    yield s
    s.stop()


def post(base_url: str, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, timeout=timeout)


def metric(base_url: str, name: str) -> float:
    """Sum of a metric over all its label sets (0 when absent)."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def error(r: httpx.Response, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    body = r.json()["error"]
    if param is not None:
        assert body["param"] == param, body
    return body["message"]


# ---------------------------------------------------------------- the shared stack


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x" * 5_000_000}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5_000_000}]},
     "messages"),
])
def test_multi_megabyte_prompt_refused_before_tokenizing(base_url, path, body, param):
    tokenized_before = metric(base_url, "sluice:input_tokenizer_chars_total")
    started = time.perf_counter()
    message = error(post(base_url, path, {**body, "max_tokens": 4}), param)
    assert time.perf_counter() - started < 5
    assert "5000" in message and "characters" in message
    # The tokenizer never saw the text: the counter of characters handed to it did not move.
    assert metric(base_url, "sluice:input_tokenizer_chars_total") == tokenized_before
    assert metric(base_url, "sluice:input_rejected_total") >= 1


def test_request_template_refused_unless_trusted(base_url):
    r = post(base_url, "/v1/chat/completions", {"messages": HI, "chat_template": "{{ 1 }}"})
    assert "--trust-request-chat-template" in error(r, "chat_template")


def test_truncate_prompt_tokens_above_the_context_is_400(base_url):
    max_len = httpx.get(f"{base_url}/v1/models", timeout=5).json()["data"][0]["max_model_len"]
    r = post(base_url, "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": max_len + 1})
    assert "larger than" in error(r, "truncate_prompt_tokens")


def test_developer_messages_and_content_parts(base_url):
    messages = [
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"},
                                     {"type": "text", "text": "Just the city."}]},
    ]
    r = post(base_url, "/v1/chat/completions",
             {"messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- budgets and truncation


@SHORT_STACK
def test_over_long_prompt_fails_with_at_least(short):
    message = error(post(short.base_url, "/v1/completions", {"prompt": LONG_PROMPT}), "prompt")
    assert f"maximum context length is {SHORT_LEN}" in message
    assert f"at least {SHORT_LEN + 1} tokens" in message


@SHORT_STACK
@pytest.mark.parametrize("side", [None, "left", "right"])
def test_truncation_is_exact_and_visible(short, side):
    truncated_before = metric(short.base_url, "sluice:input_truncated_tokens_total")
    body = {"prompt": LONG_PROMPT, "truncate_prompt_tokens": 200, "max_tokens": 3,
            "request_id": f"trunc-{side}"}
    if side is not None:
        body["truncation_side"] = side
    r = post(short.base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 200
    cut = metric(short.base_url, "sluice:input_truncated_tokens_total") - truncated_before
    assert cut >= 400  # ~601 tokens in, 200 kept
    lines = [line for line in short.proc.log().splitlines() if f"request=trunc-{side} " in line]
    assert len(lines) == 1 and f"truncated_tokens={cut:.0f}" in lines[0], lines


@SHORT_STACK
def test_truncate_to_the_maximum_leaves_one_token(short):
    body = {"prompt": LONG_PROMPT, "truncate_prompt_tokens": -1, "max_tokens": 1}
    r = post(short.base_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == SHORT_LEN - 1


@SHORT_STACK
def test_chat_truncation(short):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": LONG_PROMPT + "What word did I repeat?"}]
    r = post(short.base_url, "/v1/chat/completions",
             {"messages": messages, "truncate_prompt_tokens": 100, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 100


# ---------------------------------------------------------------- templates


@SHORT_STACK
def test_server_template_from_file_is_used(short):
    # The file's template has no default system prompt, unlike SmolLM2's own: fewer tokens.
    r = post(short.base_url, "/v1/chat/completions", {"messages": HI, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 12  # <|im_start|>user\nSay hi.<|im_end|>\n...


@SHORT_STACK
def test_trusted_request_template_and_its_errors(short):
    ok = post(short.base_url, "/v1/chat/completions", {
        "messages": HI, "max_tokens": 1,
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    })
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == 3  # "Say hi." alone
    rejected = post(short.base_url, "/v1/chat/completions", {
        "messages": HI, "chat_template": "{{ raise_exception('effort must be low or high') }}",
    })
    assert "effort must be low or high" in error(rejected, "messages")


@SHORT_STACK
def test_continue_final_message(short):
    messages = HI + [{"role": "assistant", "content": "Hi th"}]
    r = post(short.base_url, "/v1/chat/completions", {
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True,
        "max_tokens": 2,
    })
    assert r.status_code == 200, r.text
    both = post(short.base_url, "/v1/chat/completions",
                {"messages": messages, "continue_final_message": True})
    assert "add_generation_prompt" in error(both, "continue_final_message")


# ---------------------------------------------------------------- render timeout (T-8)


@SHORT_STACK
def test_stuck_template_times_out_and_the_server_moves_on(short):
    timeouts_before = metric(short.base_url, "sluice:input_render_timeouts_total")
    results = {}

    def hang():
        started = time.perf_counter()
        results["hang"] = post(short.base_url, "/v1/chat/completions", {
            "messages": HI, "chat_template_kwargs": {"hang": True},
        })
        results["hang_s"] = time.perf_counter() - started

    stuck = threading.Thread(target=hang)
    stuck.start()
    time.sleep(0.5)
    # Queued behind the stuck render on the only tokenizer thread; served once it is replaced.
    behind = post(short.base_url, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    stuck.join()
    message = error(results["hang"], "messages")
    assert "longer than 2 s" in message and "--render-timeout" in message
    assert TIMEOUT_S - 0.5 < results["hang_s"] < TIMEOUT_S + 10
    assert behind.status_code == 200, behind.text
    after = post(short.base_url, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert after.status_code == 200, after.text
    assert metric(short.base_url, "sluice:input_render_timeouts_total") == timeouts_before + 1
    assert "render timed out" in short.proc.log()
