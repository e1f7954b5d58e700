"""Start real sluice processes on loopback for tests, and always stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from shared.transport import free_tcp_port

STARTUP_TIMEOUT_S = 180


class Proc:
    def __init__(self, args: list[str], log_path: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        # Each process its own default state store (sqlite beside its log), so test servers
        # never share stored responses through the user's ~/.local/state.
        env["SLUICE_STATE_DIR"] = os.path.splitext(log_path)[0] + "-state"
        # A new session so stop() can take down the whole group (serve has children).
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "sluice", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._log.close()


def wait_until(condition, timeout: float, what: str) -> None:
    """Polls `condition` until it holds; fails the test naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def wait_healthy(base_url: str, procs: list[Proc], timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"process exited early:\n{p.log()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not healthy:\n" + "\n".join(p.log()[-3000:] for p in procs))


class Stack:
    """`sluice serve` on a free port."""

    def __init__(self, tmp_dir: str, *extra: str) -> None:
        self.port = free_tcp_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc = Proc(
            ["serve", "--port", str(self.port), *extra], os.path.join(tmp_dir, "serve.log")
        )
        try:
            wait_healthy(self.base_url, [self.proc])
        except Exception:
            self.proc.stop()
            raise

    def stop(self) -> None:
        self.proc.stop()


def metrics(base_url: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, labels dropped (one engine in tests)."""
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        values[name.split("{", 1)[0]] = float(value)
    return values


def start_frontend(tmp_dir: str, engine_address: str, name: str, *extra: str) -> tuple[Proc, str]:
    """One `sluice frontend` on a free port; wait_healthy it yourself (with the engine)."""
    port = free_tcp_port()
    proc = Proc(["frontend", "--engine-address", engine_address, "--port", str(port), *extra],
                os.path.join(tmp_dir, f"{name}.log"))
    return proc, f"http://127.0.0.1:{port}"


class Frontend:
    """One more `sluice frontend` over an engine that is already running (`Engine.frontend`):
    a test whose flags are all the frontend's gets its own server without loading the model
    again. Like `Stack`, it has `proc` and `base_url`."""

    def __init__(self, tmp_dir: str, engine: Engine, name: str, *extra: str,
                 wait: bool = True) -> None:
        self.engine = engine
        self.proc, self.base_url = start_frontend(tmp_dir, engine.address, name, *extra)
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        try:
            wait_healthy(self.base_url, [self.engine.proc, self.proc])
        except Exception:
            self.proc.stop()
            raise

    def stop(self) -> None:
        self.proc.stop()


class Engine:
    """`sluice engine` over tcp, serving its own metrics (`metrics_url`), once it answers a
    ping; `frontend()` puts frontends on it."""

    def __init__(self, tmp_dir: str, *extra: str, wait: bool = True) -> None:
        self.address = f"tcp://127.0.0.1:{free_tcp_port()}"
        metrics_port = free_tcp_port()
        self.metrics_url = f"http://127.0.0.1:{metrics_port}"
        self.proc = Proc(["engine", "--engine-address", self.address,
                          "--metrics-port", str(metrics_port), *extra],
                         os.path.join(tmp_dir, "engine.log"))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Returns once the engine answers a ping; stops it if it never does."""
        try:
            self._wait_ready()
        except Exception:
            self.proc.stop()
            raise

    def _wait_ready(self) -> None:
        from tests.engine_client import engine_stats

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"the engine exited early:\n{self.proc.log()[-4000:]}")
            try:
                engine_stats(self.address, timeout_s=2)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def frontend(self, tmp_dir: str, name: str, *extra: str) -> Frontend:
        """A frontend with these flags over this engine; whoever asks for it stops it."""
        return Frontend(tmp_dir, self, name, *extra)

    def frontends(self, tmp_dir: str, *specs: tuple[str, tuple[str, ...]]) -> list[Frontend]:
        """One frontend per (name, flags), all started at once (a start is seconds of
        imports, which they overlap), healthy when it returns; whoever asks stops them."""
        started = [Frontend(tmp_dir, self, name, *extra, wait=False) for name, extra in specs]
        try:
            for f in started:
                f.wait_healthy()
        except Exception:
            for f in started:
                f.stop()
            raise
        return started

    def stop(self) -> None:
        self.proc.stop()


def engine_and_frontend(tmp_dir: str, engine_extra: tuple[str, ...], name: str,
                        *frontend_extra: str) -> tuple[Engine, Frontend]:
    """An `Engine` and one `Frontend` over it, started at once: the frontend's start (seconds
    of imports) overlaps the engine's model load instead of following it. Whoever asks
    stops both."""
    engine = Engine(tmp_dir, *engine_extra, wait=False)
    frontend = None
    try:
        frontend = Frontend(tmp_dir, engine, name, *frontend_extra, wait=False)
        frontend.wait_healthy()  # the frontend is healthy once the engine answers it
        engine.wait_ready()
    except Exception:
        if frontend is not None:
            frontend.stop()
        engine.stop()
        raise
    return engine, frontend


class Cluster:
    """Two frontends over one engine, separate processes over tcp, as an orchestrator runs
    them; the engine serves its own metrics (`engine_metrics_url`), the frontends theirs.
    Stopping it stops its frontends, not the engine."""

    def __init__(self, engine: Engine, tmp_dir: str) -> None:
        self.engine = engine.proc
        self.engine_address = engine.address
        self.engine_metrics_url = engine.metrics_url
        self.frontends: list[Proc] = []
        self.base_urls: list[str] = []
        try:
            for i in range(2):  # both start at once, then both must be healthy
                proc, url = start_frontend(tmp_dir, engine.address, f"frontend{i}")
                self.frontends.append(proc)
                self.base_urls.append(url)
            for url in self.base_urls:
                wait_healthy(url, [self.engine, *self.frontends])
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        for p in self.frontends:
            p.stop()


class Fleet:
    """`sluice engine` with a postproc port, two frontends (the first with output parsers,
    as given) and `workers` postproc workers, all separate processes over tcp."""

    def __init__(self, tmp_dir: str, workers: int, frontend0_extra: tuple[str, ...] = (),
                 *engine_extra: str) -> None:
        self.tmp_dir = tmp_dir
        self.engine_address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.postproc_address = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.engine = Proc(
            ["engine", "--engine-address", self.engine_address,
             "--postproc-address", self.postproc_address, *engine_extra],
            os.path.join(tmp_dir, "engine.log"),
        )
        self.workers: list[Proc] = []
        self.frontends: list[Proc] = []
        self.base_urls: list[str] = []
        try:
            for i in range(workers):
                self.add_worker(f"postproc{i}")
            for i, extra in enumerate((frontend0_extra, ())):
                proc, url = start_frontend(tmp_dir, self.engine_address, f"frontend{i}", *extra)
                self.frontends.append(proc)
                self.base_urls.append(url)
            for url in self.base_urls:
                wait_healthy(url, [self.engine, *self.frontends, *self.workers])
        except Exception:
            self.stop()
            raise

    def add_worker(self, name: str) -> Proc:
        proc = Proc(["postproc", "--engine-postproc-address", self.postproc_address],
                    os.path.join(self.tmp_dir, f"{name}.log"))
        self.workers.append(proc)
        return proc

    def stop(self) -> None:
        for p in [*self.frontends, *self.workers, self.engine]:
            p.stop()
