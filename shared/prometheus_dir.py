"""Prometheus multiprocess mode for frontends (req L-3).

prometheus_client picks its value storage once, when it is first imported: in-process, or in
files under PROMETHEUS_MULTIPROC_DIR that a scrape of any frontend process sums. So the CLI
sets the directory before anything imports the library; this module must not import it.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile

ENV = "PROMETHEUS_MULTIPROC_DIR"
log = logging.getLogger("sluice")


def prepare_prometheus_dir() -> str:
    """The directory this process's metrics go to: the operator's (or `sluice serve`'s) if the
    environment names one, else a fresh one removed at exit. Stale files from an earlier run
    would be summed in, so a directory given from outside must start empty."""
    if "prometheus_client" in sys.modules:
        log.warning("prometheus_client was imported before %s was set; metrics stay "
                    "per-process", ENV)
    existing = os.environ.get(ENV)
    if existing:
        os.makedirs(existing, exist_ok=True)
        return existing
    path = tempfile.mkdtemp(prefix="sluice-metrics-")
    os.environ[ENV] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
