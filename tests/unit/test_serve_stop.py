"""How `sluice serve` stops its processes: the frontend gets its whole drain window and time
to exit after it, and a process that outstays its time is killed with a line that says so
(a silent SIGKILL skips the frontend's clean-up and leaves nothing to explain it)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from types import SimpleNamespace

from sluice import cli

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")


def test_a_process_that_outstays_its_time_is_killed_and_named(caplog):
    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE,
                                text=True)
    polite = subprocess.Popen(["sleep", "60"])
    try:
        assert stubborn.stdout.readline() == "ready\n"  # it ignores SIGTERM from now on
        with caplog.at_level(logging.WARNING, logger="sluice"):
            cli._stop([polite, stubborn], 0.5)
        assert polite.returncode == -signal.SIGTERM  # went when told: nothing said
        assert stubborn.returncode == -signal.SIGKILL
        assert [r.getMessage() for r in caplog.records] == [
            f"{sys.executable} (pid {stubborn.pid}) did not exit within 0.5s of the signal: "
            f"killing it"]
    finally:
        for p in (stubborn, polite):
            p.kill()
            p.wait()
        stubborn.stdout.close()


def test_a_child_is_named_by_its_subcommand():
    argv = [sys.executable, "-m", "sluice", "frontend", "--port", "8000"]
    assert cli._label(SimpleNamespace(args=argv)) == "frontend"
    assert cli._label(SimpleNamespace(args=["sleep", "60"])) == "sleep"


def test_serve_gives_the_frontend_its_window_and_time_to_exit(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli.subprocess, "Popen", lambda argv, **kwargs: argv)
    monkeypatch.setattr(cli, "_supervise", lambda children, **kwargs: seen.update(kwargs) or 0)
    monkeypatch.setattr(cli, "prepare_prometheus_dir", lambda: None)
    cli._serve(cli.parse_args(["serve", "--shutdown-timeout", "120"]))
    assert seen["drain_first"][0][3] == "frontend"
    # After its window the frontend still sends its last errors (2 s), lets uvicorn close
    # connections (5 s) and cleans up: more than the 5 s it once got.
    assert seen["grace_s"] == 120 + cli.FRONTEND_EXIT_S and cli.FRONTEND_EXIT_S >= 2 + 5 + 10
