"""The first hour with sluice, on one `sluice serve` started as `make serve` starts it
(issue 41): the "ready" line comes when a request would be served and nothing says
"running" before it; every curl and Python snippet in README.md and docs/ runs against it;
requests are not logged one by one unless asked; and Ctrl+C drains (naming SIGINT, /health
503 with Retry-After and Connection: close) and leaves no socket files behind.

The flags and routes the docs name are checked in tests/unit/test_docs_honest.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import Proc, free_tcp_port, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_URL = "127.0.0.1:8000"  # where the snippets expect the server
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Longer than any drain here takes (see `first_hour`); the answer's wait stays under pytest's
# 600 s timeout, so a drain that never ends fails the test with the stack's log.
DRAIN_WINDOW_S = 3600
ANSWER_WAIT_S = 400

# Snippets that are not programs, each with why. Keep it small.
NOT_RUN = {
    "from postproc.reasoning import get_reasoning_parser":
        "an outline of the parser API over placeholders (rendered, delta_text)",
    "from postproc.tool_parsers import get_tool_parser":
        "an outline of the parser API over placeholders (request, content_delta)",
    "import msgspec, zmq":
        "a KV-events consumer that runs until stopped, against an engine started with "
        "--kv-events-config (tests/integration/test_kv_events.py decodes the same wire)",
}


class Snippet:
    def __init__(self, where: str, kind: str, text: str) -> None:
        self.where, self.kind, self.text = where, kind, text


def _snippets() -> list[Snippet]:
    """Every Python block, and every curl command of the shell blocks, in README and docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            where = f"{doc.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
            lang, body = m[1], m[2]
            if lang == "python":
                found.append(Snippet(where, "python", body))
            elif lang in ("sh", "bash", ""):
                found += [Snippet(where, "curl", c) for c in _curl_commands(body)]
    return found


def _curl_commands(block: str) -> list[str]:
    """The curl commands of a shell block, each with its continuation lines and quoted
    multi-line arguments, without trailing comments."""
    commands, current = [], None
    for line in block.splitlines():
        if current is None and not line.lstrip().startswith("curl "):
            continue
        current = line if current is None else f"{current}\n{line}"
        try:
            words = shlex.split(current, comments=True)
        except ValueError:  # a quote still open
            continue
        if current.endswith("\\"):
            continue
        commands.append(shlex.join(words))
        current = None
    return commands


SNIPPETS = _snippets()


@pytest.fixture(scope="module")
def first_hour(tmp_path_factory):
    """`sluice serve` with `make serve`'s flags (on a free port), watched from its first
    moment: the "ready" line must come only once a request would be served. Requests that
    leave max_tokens out (the snippets do) get 32, to keep the module short. The drain window
    is one no request here outlasts, however slowly a loaded host decodes (the drained
    request is bounded by its tokens, pytest's timeout bounds the run): with `make serve`'s
    two torch threads on a shared 2-core machine, 256 tokens took 104 s of a 120 s window
    in one run (4.6 s on an idle one), and most likely outlasted it in the run where the
    request got a 503: the drain's own end (--shutdown-timeout), as the contract says."""
    port = free_tcp_port()
    proc = Proc(["serve", "--host", "127.0.0.1", "--port", str(port),
                 "--override-generation-config", '{"max_new_tokens": 32}',
                 "--shutdown-timeout", str(DRAIN_WINDOW_S)],
                str(tmp_path_factory.mktemp("first_hour") / "serve.log"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: "ready: " in proc.log() or proc.popen.poll() is not None, 180,
                   "the ready line")
        # At once, as a newcomer would: the first request after the line is served.
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200, (r.text, proc.log()[-3000:])
        yield proc, url
    finally:
        proc.stop()


def test_ready_is_said_once_when_the_stack_answers(first_hour):
    proc, url = first_hour
    log = proc.log()
    assert [line.split(": ", 1)[-1] for line in log.splitlines() if " ready: " in line] == \
        [f"ready: {url} serves SmolLM2-135M-Instruct (Ctrl+C to stop)"], log
    assert "running" not in log.lower(), log  # uvicorn's early "Uvicorn running on ..."
    assert log.index("engine listening on") < log.index(" is live") < log.index(" ready: ")


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.text.splitlines()[0]
                                     not in NOT_RUN], ids=lambda s: s.where)
def test_every_snippet_runs(first_hour, snippet):
    _, url = first_hour
    port = url.rsplit(":", 1)[1]
    text = snippet.text.replace(DOCS_URL, f"127.0.0.1:{port}")
    if snippet.kind == "python":
        done = subprocess.run([sys.executable, "-c", text], capture_output=True, text=True,
                              timeout=180, cwd=ROOT)
    else:
        # --fail-with-body: an HTTP error fails the snippet, and shows why.
        command = text.replace("curl ", "curl --fail-with-body -sS --max-time 180 ", 1)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                              timeout=200)
    assert done.returncode == 0, f"{snippet.where}:\n{text}\n{done.stdout}\n{done.stderr}"


def test_every_allow_listed_snippet_is_still_in_the_docs():
    firsts = {s.text.splitlines()[0] for s in SNIPPETS}
    assert set(NOT_RUN) <= firsts
    assert len(SNIPPETS) - len(NOT_RUN) >= 5  # the extraction still finds the snippets


def test_requests_are_not_logged_one_by_one_unless_asked(first_hour):
    proc, url = first_hour
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200
    assert "sluice.requests" not in proc.log()


def test_null_messages_beside_prompt_token_ids(first_hour):
    _, url = first_hour
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": None, "prompt_token_ids": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_ctrl_c_drains_names_sigint_and_leaves_no_socket_files(first_hour):
    """Last in this module: it stops the stack. Ctrl+C reaches the terminal's foreground
    process group, which is `serve` alone (its processes have their own)."""
    proc, url = first_hour
    sockets = set(re.findall(r"ipc://(/\S+?\.sock)", proc.log()))
    assert sockets and all(os.path.exists(s) for s in sockets)
    answer: dict = {}
    first_token = threading.Event()

    def long_request() -> None:
        # Streamed, so the signal goes once the request is surely running (a poll of /load
        # came back after a fast machine had finished the whole of it); 128 tokens outlast the
        # signal's way to the frontend (milliseconds) on any machine, and finish inside the
        # drain window on a loaded one.
        body = {"prompt": "Count:", "max_tokens": 128, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=ANSWER_WAIT_S) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    first_token.set()
            answer["status"], answer["events"] = response.status_code, events

    running = threading.Thread(target=long_request)
    running.start()
    assert first_token.wait(60), "the request's first token"
    os.killpg(proc.popen.pid, signal.SIGINT)
    wait_until(lambda: _health(url).status_code == 503, 30, "/health to say 503")
    health = _health(url)
    assert health.headers["retry-after"] == "1" and health.headers["connection"] == "close"
    running.join(ANSWER_WAIT_S)
    events = answer.get("events")  # none: the wait ran out
    assert answer.get("status") == 200 and events and events[-1] == "[DONE]", (  # it finished
        events and events[-3:], proc.log()[-4000:])
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 128
    assert proc.popen.wait(60) == 0
    log = proc.log()
    assert "sluice: SIGINT: stopping" in log and "sluice.frontend: SIGINT: draining" in log
    assert "draining: 1 requests in flight" in log, log  # the drain found it running
    # Nothing alarming on the way out (the grammar checker's pool warned of leaked
    # semaphores on every stop).
    # serve stops its engines with SIGTERM after the frontend drained (their own drain);
    # Ctrl+C itself is named SIGINT wherever it is reported.
    frontend_lines = [line for line in log.splitlines() if "sluice.engine" not in line]
    assert not [line for line in frontend_lines if "SIGTERM" in line], log
    assert "Traceback" not in log and "leaked" not in log, log
    assert not [s for s in sockets if os.path.exists(s)]


def _health(url: str) -> httpx.Response:
    for _ in range(50):
        try:
            return httpx.get(f"{url}/health", timeout=5)
        except httpx.HTTPError:  # Connection: close races the next connect; ask again
            time.sleep(0.05)
    raise AssertionError("/health did not answer")
