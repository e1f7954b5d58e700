"""A stream survives its engine (issue 39): two --batch-invariant engines, and frontends as
separate processes over tcp. Streams in flight on an engine that freezes or dies go on, as
continuations, on the other one: every stream completes, its text is the fault-free text
token for token (greedy and seeded), usage counts every token once, and no engine keeps a
KV page. A frontend that knows only the frozen engine waits for it; one with
--migration-limit 0 ends its streams with today's error. The second engine's outputs go
through a postproc worker, so a stream that moves crosses from the frontend's detokenizer to
the fleet's (and back, in the drain test), and an n=2 stream's two candidates, one per
engine, move apart."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from shared.transport import free_tcp_port
from tests.engine_client import engine_stats
from tests.servers import Proc, metrics, start_frontend, wait_healthy, wait_until

pytestmark = pytest.mark.slow  # two engines and three frontends of its own

# Long enough that streams still run when an engine dies or its 0.5 s drain ends, on a fast
# machine too (48 tokens had all finished inside the drain there).
MAX_TOKENS = 96
# Greedy and seeded-sampled completions, and a greedy chat: four streams per frontend.
BODIES = [
    {"prompt": "Count slowly to one thousand:", "temperature": 0},
    {"prompt": "The history of the river town begins", "temperature": 0},
    {"prompt": "Write a list of fruits:", "temperature": 0.9, "seed": 1234},
]
CHAT = {"messages": [{"role": "user", "content": "Tell me about boats."}], "temperature": 0}
# Two seeded candidates: round-robin places one on each engine.
TWO_CHOICES = {"prompt": "Name some colours:", "temperature": 0.9, "seed": 99, "n": 2}


def _body(body: dict, stream: bool) -> dict:
    return {"max_tokens": MAX_TOKENS, **body, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


class Stream:
    """One request on a thread: its SSE data lines as they come (or its whole answer)."""

    def __init__(self, url: str, body: dict, stream: bool = True) -> None:
        self.chat = "messages" in body
        self.url, self.body = url, _body(body, stream)
        self.events: list[str] = []
        self.answer: dict | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        try:
            if not self.body["stream"]:
                self.answer = httpx.post(self.url + path, json=self.body, timeout=300).json()
                return
            with httpx.stream("POST", self.url + path, json=self.body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
        except httpx.HTTPError as exc:
            self.events.append(f"transport error: {exc!r}")

    def join(self) -> None:
        self.thread.join(timeout=300)
        assert not self.thread.is_alive(), "a stream hangs"

    def result(self) -> tuple[str | tuple[str, ...], int, list[str]]:
        """(text, completion tokens, finish reasons) of a finished request; with n > 1 the
        text is each choice's, by index."""
        if self.answer is not None:
            choice = self.answer["choices"][0]
            text = choice["message"]["content"] if self.chat else choice["text"]
            return text, self.answer["usage"]["completion_tokens"], [choice["finish_reason"]]
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [json.loads(e) for e in self.events[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        pieces: dict[int, list[str]] = {}
        reasons = []
        for c in chunks:
            for choice in c["choices"]:
                pieces.setdefault(choice["index"], []).append(
                    (choice.get("delta") or {}).get("content") or ""
                    if self.chat else choice.get("text", ""))
                if choice.get("finish_reason"):
                    reasons.append(choice["finish_reason"])
        texts = tuple("".join(pieces[i]) for i in sorted(pieces))
        return (texts if len(texts) > 1 else texts[0],
                chunks[-1]["usage"]["completion_tokens"], reasons)

    def started(self) -> bool:
        return len(self.events) >= 3


class Whole(threading.Thread):
    """An answer of the other faces, Messages and Responses, streamed or not, on a thread."""

    def __init__(self, url: str, face: str, stream: bool = False) -> None:
        super().__init__(daemon=True)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        question = CHAT["messages"][0]["content"]
        if face == "messages":
            self.path, self.body = "/v1/messages", {
                "model": model, "messages": [{"role": "user", "content": question}],
                "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
        else:
            self.path, self.body = "/v1/responses", {
                "model": model, "input": question, "max_output_tokens": MAX_TOKENS,
                "temperature": 0, "stream": stream}
        self.url, self.face, self.answer = url, face, None
        self.events: list[dict] = []
        self.start()

    def run(self) -> None:
        if not self.body["stream"]:
            self.answer = httpx.post(self.url + self.path, json=self.body, timeout=300).json()
            return
        with httpx.stream("POST", self.url + self.path, json=self.body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(json.loads(line[6:]))
        # The last event carries the whole answer, as a non-streamed one would.
        last = self.events[-1] if self.events else {}
        self.answer = last.get("message") or last.get("response") or last

    def started(self) -> bool:
        return not self.body["stream"] or len(self.events) >= 5

    def result(self) -> tuple[str, int]:
        self.join(timeout=300)
        a = self.answer
        assert a is not None and not a.get("error") and a.get("type") != "error", a
        if self.face == "messages":
            if self.events:  # the final message_delta has the usage; the deltas the text
                text = "".join(e["delta"].get("text", "") for e in self.events
                               if e["type"] == "content_block_delta")
                return text, self.events[-2]["usage"]["output_tokens"]
            return "".join(b["text"] for b in a["content"]), a["usage"]["output_tokens"]
        texts = [c["text"] for item in a["output"] if item["type"] == "message"
                 for c in item["content"]]
        if self.events:
            deltas = "".join(e["delta"] for e in self.events
                             if e["type"] == "response.output_text.delta")
            assert deltas == "".join(texts)
        return "".join(texts), a["usage"]["output_tokens"]


FACES = [("messages", False), ("responses", False), ("messages", True), ("responses", True)]


def start_engine(tmp_dir: str, name: str, address: str, *extra: str) -> Proc:
    # A short drain: SIGTERM leaves streams running for the frontends to move.
    return Proc(["engine", "--engine-address", address, "--engine-id", name, "--threads", "1",
                 "--batch-invariant", "--shutdown-timeout", "0.5", *extra],
                os.path.join(tmp_dir, f"{name}.log"))


class TwoEngines:
    def __init__(self, tmp_dir: str) -> None:
        self.tmp_dir = tmp_dir
        self.addresses = [f"tcp://127.0.0.1:{free_tcp_port()}" for _ in range(2)]
        postproc = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.engines = [start_engine(tmp_dir, "engine-0", self.addresses[0]),
                        start_engine(tmp_dir, "engine-1", self.addresses[1],
                                     "--postproc-address", postproc)]
        self.worker = Proc(["postproc", "--engine-postproc-address", postproc],
                           os.path.join(tmp_dir, "postproc.log"))
        both = ["--engine-address", self.addresses[1], "--routing", "round-robin",
                "--export-engine-metrics"]
        self.frontends, self.urls = [], []
        try:
            for name, extra in (("both", both), ("limit0", [*both, "--migration-limit", "0"]),
                                ("alone", [])):
                address = self.addresses[1] if name == "alone" else self.addresses[0]
                proc, url = start_frontend(tmp_dir, address, name, *extra)
                self.frontends.append(proc)
                self.urls.append(url)
            for url in self.urls:
                wait_healthy(url, [*self.engines, *self.frontends])
            for url in self.urls[:2]:
                wait_until(lambda url=url: _engines_live(url) == 2, 60, "both engines live")
            wait_until(lambda: engine_stats(self.addresses[1]).num_postproc_workers == 1, 60,
                       "the postproc worker joined engine-1")
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for p in [*self.frontends, *self.engines, self.worker]:
            p.stop()


def _engines_live(url: str) -> int:
    return sum(1 for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
               if line.startswith("sluice:engine_live{") and line.endswith(" 1.0"))


def _migrated(url: str, reason: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice:requests_migrated_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _idle(address: str) -> bool:
    s = engine_stats(address)
    return s.num_running + s.num_waiting == 0 and s.num_free_pages == s.num_total_pages


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    t = TwoEngines(str(tmp_path_factory.mktemp("migration")))
    yield t
    t.stop()


@pytest.fixture(scope="module")
def reference(two):
    """Every body's fault-free answer, streamed, through the frontend on both engines."""
    streams = [Stream(two.urls[0], b) for b in [*BODIES, CHAT]]
    for s in streams:
        s.join()
    return [s.result() for s in streams]


@pytest.fixture(scope="module")
def two_choices_reference(two):
    stream = Stream(two.urls[0], TWO_CHOICES)
    stream.join()
    return stream.result()


@pytest.fixture(scope="module")
def face_reference(two):
    return [Whole(two.urls[0], face, stream).result() for face, stream in FACES]


def _expect(streams: list[Stream], reference) -> None:
    for s, (text, tokens, _) in zip(streams, reference, strict=True):
        s.join()
        got_text, got_tokens, reasons = s.result()
        n = s.body.get("n", 1)
        assert got_text == text, (s.body, got_text, text)
        assert got_tokens == tokens == MAX_TOKENS * n
        assert reasons == ["length"] * n


def test_a_frozen_engine_s_streams_move_or_wait(two, reference):
    """SIGSTOP one engine for 10 s, past the heartbeat timeout: the frontend with another
    engine moves its streams there; the one that knows only it waits, and goes on when it
    wakes. After
    SIGCONT the woken engine drops what moved (no duplicated text, no pages kept)."""
    both, alone = two.urls[0], two.urls[2]
    moving = [Stream(both, b) for b in [*BODIES, CHAT, BODIES[0]]]  # round-robin: 3 each
    waiting = [Stream(alone, b) for b in BODIES[:2]]
    wait_until(lambda: all(s.started() for s in moving + waiting), 120, "streams started")
    frozen = two.engines[1]
    os.kill(frozen.popen.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        wait_until(lambda: _migrated(both, "freeze") >= 1, 30, "streams moved off it")
        late = Stream(alone, BODIES[1])  # no engine answers: it waits instead of a 503
        # The bar: the only engine frozen for 10 s costs no stream.
        time.sleep(max(1.0, 10 - (time.monotonic() - frozen_at)))
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    _expect(moving, [*reference, reference[0]])
    _expect(waiting, reference[:2])
    _expect([late], reference[1:2])
    assert _migrated(alone, "freeze") == 0  # it waited: nothing moved
    for address in two.addresses:
        wait_until(lambda a=address: _idle(a), 60, "engines idle with every page free")
    log = two.frontends[0].log()
    assert "moved to engine engine-0" in log and "(freeze)" in log


def test_a_killed_engine_s_streams_continue_on_the_other(two, reference, face_reference,
                                                         two_choices_reference):
    """SIGKILL one engine mid-stream: streams (one with n=2), plain requests and the Messages
    and Responses faces complete exactly on the survivor, whose postproc worker takes the
    moved streams' text on from the frontend's; the frontend with --migration-limit 0 ends
    the dead engine's stream with a 503 error event; the survivor keeps no page; the dead
    engine's series leave /metrics."""
    both, limit0 = two.urls[0], two.urls[1]
    assigned = engine_stats(two.addresses[1]).postproc_assigned
    moving = [Stream(both, b) for b in [*BODIES, CHAT, TWO_CHOICES]]
    plain = [Stream(both, b, stream=False) for b in BODIES[:2]]
    faces = [Whole(both, face, stream) for face, stream in FACES]
    # Round-robin: one on each engine; long, so both still run when the engine dies.
    stuck = [Stream(limit0, {**b, "max_tokens": 150}) for b in BODIES[:2]]
    wait_until(lambda: all(s.started() for s in moving + stuck + faces), 120,
               "streams started")
    before = metrics(limit0)["sluice:migration_failures_total"]
    two.engines[0].popen.kill()  # SIGKILL: no goodbye on any socket
    _expect(moving, [*reference, two_choices_reference])
    assert isinstance(two_choices_reference[0], tuple)  # two distinct candidates
    assert len(set(two_choices_reference[0])) == 2
    _expect(plain, reference[:2])
    assert [f.result() for f in faces] == face_reference
    for s in stuck:
        s.join()
    errors = [json.loads(e) for s in stuck for e in s.events[:-1] if '"error"' in e]
    assert len(errors) == 1 and errors[0]["error"]["code"] == 503, errors
    assert metrics(limit0)["sluice:migration_failures_total"] == before + 1
    assert _migrated(both, "death") >= 1
    wait_until(lambda: _idle(two.addresses[1]), 60, "the survivor idle with every page free")
    # The survivor's worker took the moved requests (as well as its own).
    moved = _migrated(both, "death") + _migrated(limit0, "death")
    assert engine_stats(two.addresses[1]).postproc_assigned >= assigned + 6 + moved
    dead = [line for line in httpx.get(f"{both}/metrics", timeout=10).text.splitlines()
            if 'engine="engine-0"' in line]
    # Only this frontend's view of it stays: not live, none of our requests on it.
    assert sorted(line.split("{")[0] for line in dead) == [
        "sluice:engine_live", "sluice:engine_requests"], dead
    assert all(line.endswith(" 0.0") for line in dead), dead


def test_a_draining_engine_s_streams_finish_on_the_other(two, reference):
    """After the kill, the dead engine restarts on its address (the frontends take it back);
    then SIGTERM the other one with --shutdown-timeout 0.5: it takes nothing new, and the
    streams it still runs at the deadline go on, exactly, on the restarted engine."""
    both = two.urls[0]
    two.engines[0].stop()
    two.engines[0] = start_engine(two.tmp_dir, "engine-0-again", two.addresses[0])
    wait_until(lambda: _engines_live(both) == 2, 120, "the restarted engine")
    streams = [Stream(both, b) for b in [*BODIES, CHAT]]  # round-robin: two on each
    wait_until(lambda: all(s.started() for s in streams), 120, "streams started")
    draining = two.engines[1]
    draining.popen.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    late = Stream(both, BODIES[0])  # routed around the draining engine at once
    _expect([*streams, late], [*reference, reference[0]])
    assert draining.popen.wait(timeout=30) == 0
    assert _migrated(both, "drain") >= 1
    wait_until(lambda: _idle(two.addresses[0]), 60, "the restarted engine idle")
    assert "--shutdown-timeout passed with" in draining.log()
