"""The machine's lowest available memory over a test run, said at its end.

The suite starts many engines; a machine that runs short of memory does not fail a test
at once, it slows every process (no swap: the kernel drops the pages of shared libraries
and reads them again) and then kills one. A run that went slow or lost a worker says here
how close it came.
"""

import threading
from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def _meminfo_kib(field: str) -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class MemoryWatch:
    """Samples MemAvailable every `interval` seconds on a daemon thread."""

    def __init__(self, interval: float = 2.0) -> None:
        self.total = _meminfo_kib("MemTotal")
        self.lowest = _meminfo_kib("MemAvailable")
        self._stop = threading.Event()
        self._interval = interval
        threading.Thread(target=self._run, name="memory-watch", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            available = _meminfo_kib("MemAvailable")
            if available is not None and (self.lowest is None or available < self.lowest):
                self.lowest = available

    def summary(self) -> str | None:
        self._stop.set()
        if self.total is None or self.lowest is None:
            return None  # not Linux
        gib = 1 << 20
        return (f"lowest available memory during the run: {self.lowest / gib:.1f} GiB "
                f"of {self.total / gib:.1f} GiB")
