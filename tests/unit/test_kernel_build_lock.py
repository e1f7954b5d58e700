"""The CPU kernels' build lock: a build killed mid-compile must not block the next one.

torch's loader waits as long as its lock file exists, and a killed build leaves it behind; the
engine's own flock (released by the OS when its holder dies) is what makes clearing it safe.
These tests kill a real process holding the lock, as a killed build would be, without
compiling anything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from engine.kernels.cpu_kernels import TORCH_LOCK, build_lock

HOLDER = """
import sys, time
from pathlib import Path
from engine.kernels.cpu_kernels import TORCH_LOCK, build_lock
directory = Path(sys.argv[1])
with build_lock(directory):
    (directory / TORCH_LOCK).touch()  # what torch's loader creates while it compiles
    print("holding", flush=True)
    time.sleep(600)
"""


def start_holder(directory):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)],
                              stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert holder.stdout.readline().strip() == "holding"
    return holder


def acquired_within(directory, seconds: float) -> bool:
    done = threading.Event()

    def take():
        with build_lock(directory):
            done.set()

    threading.Thread(target=take, daemon=True).start()
    return done.wait(seconds)


def test_a_killed_build_leaves_nothing_that_blocks_the_next(tmp_path):
    holder = start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (tmp_path / TORCH_LOCK).exists()  # the killed build's lock file is still there
    with build_lock(tmp_path):
        assert not (tmp_path / TORCH_LOCK).exists()


def test_a_live_build_still_keeps_the_next_waiting(tmp_path):
    holder = start_holder(tmp_path)
    try:
        assert not acquired_within(tmp_path, 1.0)
        assert (tmp_path / TORCH_LOCK).exists()  # a live build's lock file is left alone
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert acquired_within(tmp_path, 30.0)
