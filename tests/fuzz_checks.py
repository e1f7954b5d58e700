"""What the fuzz suites (tests/integration/test_fuzz.py, test_schemathesis.py) require of every
answer and of the stack after a run (issue 15 item 8).

Every answer: no 5xx; a refusal's body in its API's error shape (OpenAI's, or Anthropic's
under /v1/messages); a stream's error events no 5xx either (a stream that started with a 200
reports failures in-band). After the run: every process of `sluice serve` still alive,
`/health` 200, and the engine idle again (nothing running or waiting, every KV page free).
"""

from __future__ import annotations

import json
import os
import time

import httpx

from frontend.base.errors import is_anthropic_path
from tests.servers import Stack, metrics

_ANTHROPIC_5XX = {"api_error", "overloaded_error", "timeout_error"}


def answer_problem(path: str, status: int, content_type: str, body: bytes) -> str | None:
    """Why this answer breaks the rules, or None when it keeps them."""
    if status >= 500:
        return f"{status} server error: {body[:2000]!r}"
    if status >= 400:
        return error_shape_problem(path, status, body)
    if content_type.startswith("text/event-stream"):
        return stream_problem(path, body)
    return None


def error_shape_problem(path: str, status: int, body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:500]!r}"
    if is_anthropic_path(path):
        ok = (isinstance(parsed, dict) and set(parsed) == {"type", "error"}
              and parsed["type"] == "error" and isinstance(parsed["error"], dict)
              and set(parsed["error"]) == {"type", "message"}
              and isinstance(parsed["error"]["message"], str) and parsed["error"]["message"])
        shape = '{"type": "error", "error": {"type", "message"}}'
    else:
        error = parsed.get("error") if isinstance(parsed, dict) else None
        ok = (isinstance(error, dict) and set(parsed) == {"error"}
              and set(error) == {"message", "type", "param", "code"}
              and isinstance(error["message"], str) and error["message"]
              and isinstance(error["type"], str) and error["code"] == status
              and (error["param"] is None or isinstance(error["param"], str)))
        shape = '{"error": {"message", "type", "param", "code": status}}'
    return None if ok else f"{status} body not in the error shape {shape}: {body[:500]!r}"


def stream_problem(path: str, body: bytes) -> str | None:
    """A 5xx reported inside a server-sent event stream (each API has its own event)."""
    for line in body.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            return f"stream event is not JSON: {line[:300]!r}"
        if not isinstance(event, dict):
            continue
        error = event.get("error")
        if isinstance(error, dict) and isinstance(error.get("code"), int):  # OpenAI chat
            if error["code"] >= 500:
                return f"stream error event {error['code']}: {line[:1000]}"
        elif event.get("type") == "error" and event.get("code") == "server_error":  # Responses
            return f"stream error event: {line[:1000]}"
        elif (is_anthropic_path(path) and event.get("type") == "error" and isinstance(error, dict)
              and error.get("type") in _ANTHROPIC_5XX):
            return f"stream error event: {line[:1000]}"
    return None


def children(pid: int) -> list[int]:
    """The processes `sluice serve` started (engine, frontend, postproc workers)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found.extend(int(p) for p in f.read().split())
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stack_problems(stack: Stack, pids: list[int], idle_within_s: float = 30) -> list[str]:
    """Everything wrong with the stack after a fuzz run (empty when it is fine)."""
    problems = []
    if stack.proc.popen.poll() is not None:
        problems.append(f"sluice serve exited with {stack.proc.popen.returncode}")
    problems += [f"child process {pid} exited" for pid in pids if not alive(pid)]
    if problems:
        return problems + [f"log tail:\n{stack.proc.log()[-4000:]}"]
    try:
        health = httpx.get(f"{stack.base_url}/health", timeout=10).status_code
    except httpx.HTTPError as exc:
        return [f"/health did not answer: {exc!r}"]
    if health != 200:
        problems.append(f"/health {health}")
    deadline = time.monotonic() + idle_within_s
    while True:  # aborted requests take a step or two to leave the engine
        now = metrics(stack.base_url)
        busy = now["sluice:num_requests_running"] + now["sluice:num_requests_waiting"]
        used = now["sluice:kv_cache_total_pages"] - now["sluice:kv_cache_free_pages"]
        if busy == 0 and used == 0:
            return problems
        if time.monotonic() > deadline:
            return problems + [f"engine not idle {idle_within_s:.0f} s after the run: "
                               f"{busy:.0f} requests running or waiting, {used:.0f} KV pages "
                               f"in use"]
        time.sleep(0.5)


# The configuration; a short context bounds what any accepted request can cost (every
# field is still fuzzed in full: a null max_tokens runs to the context's end), and the timeout
# turns a request that runs away into a 504, well past what ~100 tokens take on a busy host.
# One torch thread: the fuzzers send thousands of one-token requests one at a time, and on a
# busy 2-core machine a step's second thread waits for a core the frontend and the postproc
# workers hold (measured there: 0.28 s a request with one thread, 1.2 s with two).
STACK_ARGS = ("--postproc-workers", "2", "--tool-call-parser", "hermes",
              "--max-model-len", "128", "--request-timeout", "60", "--threads", "1")

# Boundary values (issue 15 item 3): where int32, int64, uint64 and float32 end, and past.
BOUNDARY_INTS = (0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1,
                 2**64, 10**30)
BOUNDARY_FLOATS = (1e-45, 5e-324, -0.0, 1e308, -1e308, 3.5e38, -3.5e38, 1e-7, 0.5)
DEEP = 1000
DEEP_JSON_TEXT = "[" * DEEP + "]" * DEEP  # a string field that is parsed as JSON
BOUNDARY_STRINGS = ("", "x" * 20_000, "\u202e\u0000\uffff\U0001f600\u0301",
                    "\ud7ff\ue000 \t\n\r", "\ud800", "null", "{", DEEP_JSON_TEXT, "<|im_start|>",
                    "--5")
