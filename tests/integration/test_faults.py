"""Faults an orchestrator causes (req L-1, L-2, issue 9): a killed engine, a drained frontend,
a client that leaves. One engine and two frontends as separate processes over tcp."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from shared.transport import free_tcp_port
from tests.servers import Proc, metrics, start_frontend, wait_healthy, wait_until

pytestmark = pytest.mark.slow  # starts its own engine (twice) and frontends

LONG = {"prompt": "Count slowly to one thousand:", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}
DRAIN_WINDOW_S = 3600


class Faults:
    def __init__(self, tmp_dir: str) -> None:
        self.tmp_dir = tmp_dir
        self.address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.engines: list[Proc] = []
        self.frontends: list[Proc] = []
        self.urls: list[str] = []
        self.start_engine()
        for i in range(2):
            # A drain window no stream here outlasts, however slowly the machine decodes:
            # the drained stream is bounded by its tokens, and pytest's timeout bounds the run.
            # Each test reads the engine's series off one frontend's /metrics.
            # A short wait for a lost engine: with none to move to, requests fail after it.
            proc, url = start_frontend(tmp_dir, self.address, f"frontend{i}", "--shutdown-timeout",
                                       str(DRAIN_WINDOW_S), "--export-engine-metrics",
                                       "--engine-timeout", "2")
            self.frontends.append(proc)
            self.urls.append(url)
        for url in self.urls:
            wait_healthy(url, [self.engines[-1], *self.frontends])

    def start_engine(self) -> None:
        n = len(self.engines)
        # One torch thread, as the session engine (tests/conftest.py says why). Its drain
        # window, too, is one no stream here outlasts (the last test drains it).
        self.engines.append(Proc(["engine", "--engine-address", self.address, "--threads", "1",
                                  "--shutdown-timeout", str(DRAIN_WINDOW_S)],
                                 os.path.join(self.tmp_dir, f"engine{n}.log")))

    def stop(self) -> None:
        for p in [*self.frontends, *self.engines]:
            p.stop()


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    f = Faults(str(tmp_path_factory.mktemp("faults")))
    yield f
    f.stop()


def _stream(url: str, out: dict, key, body: dict = LONG) -> None:
    """A streamed completion; out[key] = the data lines, as they come."""
    events = out.setdefault(key, [])
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")


def _plain(url: str, out: dict, key) -> None:
    try:
        r = httpx.post(f"{url}/v1/completions", json=LONG, timeout=120)
        out[key] = (r.status_code, r.json())
    except httpx.HTTPError as exc:
        out[key] = (0, repr(exc))



def _idle(m: dict[str, float]) -> bool:
    return m["sluice:num_requests_running"] + m["sluice:num_requests_waiting"] == 0


def _error_shape(body: dict, status: int) -> None:
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == status and body["error"]["message"], body


def test_engine_killed_under_load_fails_requests_then_recovers(faults):
    out: dict = {}
    threads = []
    for url in faults.urls:
        for i in range(2):
            threads.append(threading.Thread(target=_stream, args=(url, out, (url, "s", i))))
        threads.append(threading.Thread(target=_plain, args=(url, out, (url, "p"))))
    for t in threads:
        t.start()
    # Every request is generating: the streams have tokens, the engine runs all six.
    wait_until(lambda: all(len(out.get((u, "s", i), [])) >= 2
                           for u in faults.urls for i in range(2))
               and metrics(faults.urls[0])["sluice:num_requests_running"] == 6, 120, "the load")

    faults.engines[-1].popen.kill()  # SIGKILL: no goodbye on any socket
    killed = time.monotonic()
    # Sent before the frontends notice: queued on connections to nowhere, then failed.
    for url in faults.urls:
        threads.append(threading.Thread(target=_plain, args=(url, out, (url, "late"))))
        threads[-1].start()
    for t in threads:
        t.join(timeout=60)
    # The dropped connection is seen at once; with no engine to move to, each frontend
    # waits --engine-timeout (2 s) for one, then fails its requests.
    assert time.monotonic() - killed < 20
    for url in faults.urls:
        for i in range(2):
            events = out[(url, "s", i)]
            assert events[-1] == "[DONE]", events[-3:]
            _error_shape(json.loads(events[-2]), 503)
        for key in ((url, "p"), (url, "late")):
            status, body = out[key]
            assert status == 503
            _error_shape(body, 503)
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503
        _error_shape(r.json(), 503)
        assert metrics(url)["sluice:engine_up"] == 0.0

    # A new engine on the same address: the frontends, never restarted, pick it up.
    faults.start_engine()
    for url in faults.urls:
        wait_healthy(url, [faults.engines[-1], *faults.frontends])
    # The failed requests stayed dead: none reached the new engine from an old queue.
    time.sleep(1)
    for url in faults.urls:
        assert _idle(metrics(url))
    for url in faults.urls:
        r = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 3}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    assert all(p.popen.poll() is None for p in faults.frontends)


def test_sigterm_drains_a_running_stream(faults):
    proc, url = faults.frontends[1], faults.urls[1]
    out: dict = {}
    body = {**LONG, "max_tokens": 200, "stream": True,
            "stream_options": {"include_usage": True}}

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
            out["status"] = r.status_code
            out["events"] = events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: len(out.get("events", [])) >= 2, 120, "the first tokens")
    proc.popen.send_signal(signal.SIGTERM)
    # Draining: probes and new requests get 503 while the stream goes on.
    wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, 10, "health 503")
    r = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "Retry-After" in r.headers
    _error_shape(r.json(), 503)
    # 200 tokens outlast the signal on any machine: the drain found the stream running.
    assert "draining: 1 requests in flight" in proc.log()
    t.join()  # its 200 tokens, however long they take (the drain window is longer)
    events = out["events"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 200
    assert all("error" not in json.loads(e) for e in events[:-1])
    assert proc.popen.wait(timeout=30) == 0  # then it exits, cleanly


def test_a_drain_that_runs_out_ends_the_stream_with_an_error(faults):
    """The other side of the drain: a stream still running when --shutdown-timeout runs out
    gets an error event and [DONE], not a cut connection, and the engine frees its pages."""
    proc, url = start_frontend(faults.tmp_dir, faults.address, "frontend-short-drain",
                               "--shutdown-timeout", "1", "--export-engine-metrics")
    try:
        wait_healthy(url, [faults.engines[-1], proc])
        out: dict = {}
        # 2,000 tokens outlast a one-second window on any machine.
        body = {**LONG, "max_tokens": 2000}
        t = threading.Thread(target=_stream, args=(url, out, "s"), kwargs={"body": body})
        t.start()
        wait_until(lambda: len(out.get("s", [])) >= 2, 120, "the first tokens")
        proc.popen.send_signal(signal.SIGTERM)
        t.join()
        events = out["s"]
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])
        _error_shape(error, 503)
        assert "drain window (--shutdown-timeout 1 s)" in error["error"]["message"]
        assert all("error" not in json.loads(e) for e in events[:-2])
        assert proc.popen.wait(timeout=30) == 0
    finally:
        proc.stop()
    other = faults.urls[0]
    wait_until(lambda: _idle(metrics(other)), 60, "the engine to let the stream go")
    m = metrics(other)
    assert m["sluice:kv_cache_free_pages"] == m["sluice:kv_cache_total_pages"]


def test_disconnect_of_a_plain_request_frees_its_pages(faults):
    url = faults.urls[0]
    # An idle engine first: an earlier request's abort still on its way (a stream a test
    # left mid-way) would otherwise land after `before` and count as this one's.
    wait_until(lambda: _idle(metrics(url)), 60, "an idle engine")
    before = metrics(url)
    payload = json.dumps(LONG).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_until(lambda: metrics(url)["sluice:num_requests_running"] == 1, 60, "the request")
    # The socket is closed; the frontend notices and aborts the request in the engine.
    wait_until(lambda: metrics(url)["sluice:requests_aborted_total"]
          == before["sluice:requests_aborted_total"] + 1, 30, "the abort")
    now = metrics(url)
    assert now["sluice:num_requests_running"] == 0
    assert now["sluice:kv_cache_free_pages"] == now["sluice:kv_cache_total_pages"]


def _clean_stream(events: list[str], tokens: int) -> None:
    """Every token came, and no error on the way."""
    assert events[-1] == "[DONE]", events[-3:]
    assert all("error" not in json.loads(e) for e in events[:-1]), events[-3:]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == tokens


def test_a_stalled_frontend_does_not_take_its_engine_for_frozen(faults):
    """A frontend stopped past the heartbeat timeout (as a loaded host can starve one) heard
    nothing because it did not run: on waking it blames neither engine nor stream (it once
    said the engine "stopped answering" and held its requests), and the stream goes on."""
    proc, url = faults.frontends[0], faults.urls[0]
    out: dict = {}
    body = {**LONG, "max_tokens": 300, "stream_options": {"include_usage": True}}
    t = threading.Thread(target=_stream, args=(url, out, "s"), kwargs={"body": body})
    t.start()
    wait_until(lambda: len(out.get("s", [])) >= 2, 120, "the first tokens")
    seen = len(proc.log())
    os.kill(proc.popen.pid, signal.SIGSTOP)
    try:
        time.sleep(7)  # past the 5 s heartbeat timeout; under the engine's 10 s for frontends
    finally:
        os.kill(proc.popen.pid, signal.SIGCONT)
    t.join()
    _clean_stream(out["s"], 300)
    assert "stopped answering" not in proc.log()[seen:], proc.log()[seen:]


def test_a_draining_engine_gone_silent_finishes_its_stream(faults):
    """Last here: it drains the engine away. An engine that drains (SIGTERM) and goes silent
    past the heartbeat timeout (SIGSTOP; a loaded host can starve it as long) is frozen, not
    gone: with no other engine the stream waits for it and goes on there when it answers.
    It was taken for drained away: the stream was aborted on it and, with the draining engine
    never live again, ended with "the engine stopped responding" though the engine would have
    finished it."""
    proc, url = start_frontend(faults.tmp_dir, faults.address, "frontend-patient",
                               "--engine-timeout", "10")  # waits out the silence below
    engine = faults.engines[-1]
    try:
        wait_healthy(url, [engine, proc])
        out: dict = {}
        body = {**LONG, "max_tokens": 300, "stream_options": {"include_usage": True}}
        t = threading.Thread(target=_stream, args=(url, out, "s"), kwargs={"body": body})
        t.start()
        wait_until(lambda: len(out.get("s", [])) >= 2, 120, "the first tokens")
        engine.popen.send_signal(signal.SIGTERM)
        # Its only engine drains: nothing new may go there, so /health says 503.
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, 10, "the drain")
        os.kill(engine.popen.pid, signal.SIGSTOP)
        try:
            # Until the frontend acted on the silence (an error line on the engine, its
            # heartbeat timeout after the stop), not merely found it late.
            wait_until(lambda: "ERROR sluice.frontend: engine " in proc.log(), 30,
                       "the frontend to find it silent")
        finally:
            os.kill(engine.popen.pid, signal.SIGCONT)
        t.join()
        _clean_stream(out["s"], 300)
        assert engine.popen.wait(timeout=60) == 0
        assert "drained: every request finished" in engine.log()
    finally:
        proc.stop()
