"""No work for nobody (issue 15, item 7), with real processes: the engine aborts the requests
of a frontend that stopped heartbeating, and a frontend that failed requests because the
engine went silent aborts them when the engine answers again."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from shared.transport import free_tcp_port
from tests.engine_client import engine_stats
from tests.servers import Proc, start_frontend, wait_healthy, wait_until

pytestmark = pytest.mark.slow  # an engine and frontends of its own, and a few freezes

FRONTEND_TIMEOUT_S = 4
LONG = {"prompt": "Count slowly to one thousand:", "max_tokens": 2000, "temperature": 0,
        "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("nobody"))
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = Proc(["engine", "--engine-address", address,
                 "--frontend-timeout", str(FRONTEND_TIMEOUT_S), "--threads", "1"],
                os.path.join(tmp, "engine.log"))
    yield proc, address, tmp
    proc.stop()


def _frontend(engine, name: str, *extra: str) -> tuple[Proc, str]:
    proc, address, tmp = engine
    frontend, url = start_frontend(tmp, address, name, *extra)
    wait_healthy(url, [proc, frontend])
    return frontend, url


def _stream(url: str) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=120) as r:
            for _ in r.iter_lines():
                pass
    except httpx.HTTPError:
        pass  # the frontend was frozen or killed under it: expected


def _start_load(url: str, n: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=_stream, args=(url,), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads



def _idle(address: str) -> bool:
    s = engine_stats(address)
    return (s.num_running == 0 and s.num_waiting == 0
            and s.num_free_pages == s.num_total_pages)


def test_engine_aborts_requests_of_a_frozen_frontend(engine):
    proc, address, _ = engine
    frontend, url = _frontend(engine, "frozen")
    try:
        before = engine_stats(address).num_aborted
        _start_load(url, 3)
        wait_until(lambda: engine_stats(address).num_running == 3, 120, "the load")
        os.kill(frontend.popen.pid, signal.SIGSTOP)  # heartbeats stop, the socket stays open
        wait_until(lambda: _idle(address), 60, "the engine to drop the frozen frontend's work")
        assert engine_stats(address).num_aborted - before == 3
        assert proc.popen.poll() is None
    finally:
        os.kill(frontend.popen.pid, signal.SIGCONT)
        frontend.stop()


def test_engine_aborts_requests_of_a_killed_frontend(engine):
    proc, address, _ = engine
    frontend, url = _frontend(engine, "killed")
    try:
        before = engine_stats(address).num_aborted
        _start_load(url, 2)
        wait_until(lambda: engine_stats(address).num_running == 2, 120, "the load")
        os.killpg(frontend.popen.pid, signal.SIGKILL)
        wait_until(lambda: _idle(address), 60, "the engine to drop the dead frontend's work")
        assert engine_stats(address).num_aborted - before == 2
    finally:
        frontend.stop()


def test_resumed_engine_drops_requests_its_frontend_gave_up_on(engine):
    proc, address, _ = engine
    # It waits 2 s (--engine-timeout) for the silent engine, then gives up on its requests.
    frontend, url = _frontend(engine, "patient", "--engine-timeout", "2")
    try:
        before = engine_stats(address)
        threads = _start_load(url, 3)
        wait_until(lambda: engine_stats(address).num_running == 3, 120, "the load")
        os.kill(proc.popen.pid, signal.SIGSTOP)
        # Past the heartbeat timeout (5 s) and --engine-timeout: it fails the three.
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        os.kill(proc.popen.pid, signal.SIGCONT)
        wait_until(lambda: _idle(address), 60, "the resumed engine to drop the requests")
        after = engine_stats(address)
        assert after.num_aborted - before.num_aborted == 3
        assert after.num_finished == before.num_finished
        # The frontend's own aborts did it (the engine's watch gives it a fresh timeout
        # after its own freeze), as soon as the engine answered.
        wait_healthy(url, [proc, frontend], timeout=30)
        assert "aborting the 3 requests failed while it was silent" in frontend.log()
    finally:
        os.kill(proc.popen.pid, signal.SIGCONT)
        frontend.stop()
