"""Tests for `sluice bench`: percentile math, the SSE parser, and end-to-end runs against a
tiny streaming server on loopback."""

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import msgspec
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from sluice.bench.chat import add_bench_arguments
from sluice.bench.command import run_bench
from sluice.bench.stats import BenchResult, percentile
from sluice.bench.wire import DONE, ChatChunk, StreamError, parse_sse_line

# ---- percentiles --------------------------------------------------------------------


def test_percentile_empty_is_none():
    assert percentile([], 50) is None


def test_percentile_single_value():
    assert percentile([7.0], 50) == 7.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_linear_interpolation_matches_numpy_default():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    # rank = 0.99 * 3 = 2.97 -> 3 + 0.97 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)


def test_percentile_on_1_to_100():
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)


# ---- SSE parser ---------------------------------------------------------------------

ROLE_CHUNK = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    '"finish_reason":null}]}'
)
CONTENT_CHUNK = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]}'
)
REASONING_CHUNK = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"reasoning_content":"Let me think"},"finish_reason":null}]}'
)
FINISH_CHUNK = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}'
)
USAGE_CHUNK = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":42,"total_tokens":54}}'
)


def test_parse_content_and_reasoning_chunks():
    content = parse_sse_line(CONTENT_CHUNK)
    assert isinstance(content, ChatChunk) and content.text() == "Hello"
    reasoning = parse_sse_line(REASONING_CHUNK)
    assert isinstance(reasoning, ChatChunk) and reasoning.text() == "Let me think"


def test_parse_chunks_without_text():
    for line in (ROLE_CHUNK, FINISH_CHUNK):
        chunk = parse_sse_line(line)
        assert isinstance(chunk, ChatChunk) and chunk.text() == ""


def test_parse_usage_chunk():
    chunk = parse_sse_line(USAGE_CHUNK)
    assert isinstance(chunk, ChatChunk)
    assert chunk.choices == [] and chunk.usage.completion_tokens == 42


def test_parse_done_with_and_without_space():
    assert parse_sse_line("data: [DONE]") is DONE
    assert parse_sse_line("data:[DONE]") is DONE


@pytest.mark.parametrize("line", ["", ": keep-alive", ":", "event: message", "id: 3", "data: "])
def test_parse_ignores_blank_comment_and_other_fields(line):
    assert parse_sse_line(line) is None


def test_parse_errors_in_stream():
    vllm = parse_sse_line('data: {"error": {"message": "boom", "code": 500}}')
    assert isinstance(vllm, StreamError) and "boom" in vllm.message
    llama = parse_sse_line('error: {"code":500,"message":"slot failed"}')
    assert isinstance(llama, StreamError) and "slot failed" in llama.message


def test_parse_malformed_json_raises():
    with pytest.raises(msgspec.DecodeError):
        parse_sse_line("data: {not json")


# ---- end to end against a fake server -------------------------------------------------

MODEL_ID = "fake-model"
CONTENT_CHUNKS = 5
# Deliberately different from CONTENT_CHUNKS so the tests tell usage from the fallback.
USAGE_TOKENS = 6


class FakeServer(msgspec.Struct):
    """Knobs and a request log for the fake OpenAI server."""

    fail_every: int = 0  # every fail_every-th request gets a 500
    send_usage: bool = True
    send_done: bool = True
    delay_s: float = 0.002
    bodies: list[dict[str, Any]] = []
    client_ports: set[int] = set()  # one per TCP connection the bench opened
    spec_metrics: bool = False  # /metrics with vLLM's spec_decode series (3 drafted, 2 taken)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _delta_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {"id": "c1", "object": "chat.completion.chunk", "model": MODEL_ID, "choices": [choice]}


async def _stream(server: FakeServer, include_usage: bool) -> Any:
    yield _sse(_delta_chunk({"role": "assistant", "content": ""}))
    yield ": keep-alive\n\n"
    for i in range(CONTENT_CHUNKS):
        await asyncio.sleep(server.delay_s)
        yield _sse(_delta_chunk({"content": f"tok{i} "}))
    yield _sse(_delta_chunk({}, finish="length"))
    if include_usage and server.send_usage:
        usage = {"prompt_tokens": 3, "completion_tokens": USAGE_TOKENS, "total_tokens": 9}
        yield _sse({"id": "c1", "object": "chat.completion.chunk", "choices": [], "usage": usage})
    if server.send_done:
        yield "data: [DONE]\n\n"


def make_app(server: FakeServer) -> Starlette:
    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]})

    async def chat(request: Request) -> Any:
        body = await request.json()
        server.bodies.append(body)
        server.client_ports.add(request.client.port)
        if server.fail_every and len(server.bodies) % server.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        include_usage = body.get("stream_options", {}).get("include_usage", False)
        return StreamingResponse(_stream(server, include_usage), media_type="text/event-stream")

    async def prometheus(_: Request) -> Any:
        if not server.spec_metrics:
            return JSONResponse({}, status_code=404)
        n = len(server.bodies)
        return PlainTextResponse(
            f"vllm:spec_decode_num_drafts_total{{engine=\"0\"}} {n}.0\n"
            f"vllm:spec_decode_num_draft_tokens_total{{engine=\"0\"}} {3 * n}.0\n"
            f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\"}} {2 * n}.0\n")

    routes = [Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/metrics", prometheus)]
    return Starlette(routes=routes)


@contextmanager
def serving(server: FakeServer) -> Iterator[str]:
    """Run the fake app with uvicorn in a thread on a free loopback port; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the kernel picks a free port, and we keep the socket
    config = uvicorn.Config(make_app(server), log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not uv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def fake_server() -> Iterator[Callable[..., tuple[FakeServer, str]]]:
    """Start fake servers with the given knobs; all are stopped when the test ends."""
    with ExitStack() as stack:

        def start(**knobs: Any) -> tuple[FakeServer, str]:
            server = FakeServer(**knobs)
            return server, stack.enter_context(serving(server))

        yield start


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults():
    args = bench_args()
    assert args.base_url == "http://127.0.0.1:8000/v1"
    assert args.concurrency == 8 and args.num_requests is None and args.max_tokens == 128
    assert args.warmup == 1 and not args.ignore_eos and not args.json


def test_end_to_end_counts_tokens_from_usage(fake_server, capsys):
    server, url = fake_server()
    result = run_bench(bench_args("--base-url", url, "--concurrency", "4", "--max-tokens", "5"))
    assert result.model == MODEL_ID  # discovered from GET /models
    assert result.num_requests == 16  # 4 x concurrency
    assert (result.completed, result.errors) == (16, 0)
    assert result.output_tokens == 16 * USAGE_TOKENS
    assert result.mean_output_tokens == USAGE_TOKENS
    assert result.output_tokens_per_s > 0 and result.requests_per_s > 0
    assert result.ttft_p50_ms > 0 and result.ttft_p99_ms >= result.ttft_p50_ms
    assert result.itl_p50_ms > 0 and result.itl_p99_ms >= result.itl_p50_ms
    assert len(server.bodies) == 17  # one warmup request, untimed
    assert len(server.client_ports) <= 4  # kept-alive connections are reused
    body = server.bodies[0]
    assert body["model"] == MODEL_ID and body["stream"] is True and body["max_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body  # only sent when asked for
    report = capsys.readouterr().out
    assert "16 ok, 0 errors" in report and "TTFT p50 / p99" in report


def test_speculative_decoding_counts_of_the_timed_run_are_reported(fake_server, capsys):
    _, url = fake_server(spec_metrics=True)
    result = run_bench(bench_args("--base-url", url, "--concurrency", "2", "--num-requests",
                                  "4"))
    # The warmup request's drafts were before the timed run.
    assert (result.spec_drafts, result.spec_draft_tokens, result.spec_accepted_tokens) == (
        4, 12, 8)
    assert "4 drafts, 8/12 draft tokens accepted (66.7%), 2.00 per draft" in (
        capsys.readouterr().out)
    _, plain = fake_server()
    result = run_bench(bench_args("--base-url", plain, "--num-requests", "2"))
    assert result.spec_draft_tokens is None
    assert "speculative" not in capsys.readouterr().out


def test_end_to_end_without_usage_counts_content_chunks(fake_server):
    _, url = fake_server(send_usage=False)
    args = bench_args("--base-url", url, "--concurrency", "3", "--num-requests", "6")
    result = run_bench(args)
    assert (result.completed, result.errors) == (6, 0)
    assert result.output_tokens == 6 * CONTENT_CHUNKS


def test_http_500_is_counted_as_error(fake_server, capsys):
    server, url = fake_server(fail_every=3)
    argv = ["--base-url", url, "--model", "m", "--concurrency", "4", "--num-requests", "12"]
    result = run_bench(bench_args(*argv, "--warmup", "0", "--json"))
    assert (result.completed, result.errors) == (8, 4)
    assert result.output_tokens == 8 * USAGE_TOKENS
    assert any("HTTP 500" in e and "injected failure" in e for e in result.error_samples)
    assert all(b["model"] == "m" for b in server.bodies)  # --model skips discovery
    printed = msgspec.json.decode(capsys.readouterr().out, type=BenchResult)
    assert printed == result


def test_stream_without_done_is_an_error(fake_server):
    _, url = fake_server(send_done=False)
    args = bench_args("--base-url", url, "--concurrency", "2", "--num-requests", "4")
    result = run_bench(args)
    assert (result.completed, result.errors) == (0, 4)
    assert result.output_tokens == 0 and result.ttft_p50_ms is None
    assert result.error_samples == ["stream ended without [DONE]"]


def test_ignore_eos_fresh_connections_and_prompt_file(fake_server, tmp_path):
    server, url = fake_server()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    argv = ["--base-url", url, "--concurrency", "2", "--num-requests", "4", "--warmup", "0"]
    extra = ["--ignore-eos", "--fresh-connections", "--prompt-file", str(prompts)]
    result = run_bench(bench_args(*argv, *extra))
    assert (result.completed, result.errors) == (4, 0)
    assert all(b["ignore_eos"] is True for b in server.bodies)
    assert len(server.client_ports) == 4  # a new connection for every request
    sent = sorted(b["messages"][0]["content"] for b in server.bodies)
    assert sent == ["first prompt"] * 2 + ["second prompt"] * 2


def dead_base_url() -> str:
    """A loopback URL where nothing listens, so connects are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_connection_refused_is_counted_not_raised():
    argv = ["--model", "m", "--concurrency", "2", "--num-requests", "3"]
    result = run_bench(bench_args("--base-url", dead_base_url(), *argv))
    assert (result.completed, result.errors) == (0, 3)
    assert "ConnectError" in result.error_samples[0]


def test_model_discovery_failure_exits_with_message():
    with pytest.raises(SystemExit, match="cannot list models"):
        run_bench(bench_args("--base-url", dead_base_url()))


def test_cpu_of_a_server_process_is_reported_per_token(fake_server, capsys):
    import os

    _, url = fake_server()
    args = bench_args("--base-url", url, "--concurrency", "2", "--num-requests", "4",
                      "--cpu-pid", str(os.getpid()))
    result = run_bench(args)
    # The fake server runs in this process, so its CPU time is this process's.
    assert result.process_cpu_s is not None and result.process_cpu_s >= 0
    assert result.cpu_ms_per_token == pytest.approx(
        result.process_cpu_s * 1000 / result.output_tokens)
    assert "per output token" in capsys.readouterr().out


def test_processes_cpu_counts_a_busy_process():
    import subprocess
    import sys

    from sluice.bench.chat import processes_cpu_s

    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nt=time.process_time()\n"
                             "while time.process_time()-t<0.5: pass\ninput()"],
                            stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while processes_cpu_s([busy.pid]) < 0.45:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        busy.kill()
        busy.wait()
    with pytest.raises(SystemExit):
        processes_cpu_s([busy.pid])
