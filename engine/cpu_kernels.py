"""The engine's own CPU kernels (engine/csrc/cpu_kernels.cpp): fused RMSNorm, RoPE,
SiLU-and-mul and a paged decode attention that reads the KV cache in place.

They are compiled once per virtual environment with the machine's C++ compiler (`make
install` does it; otherwise the first engine that wants them does, under a file lock), into
`<venv>/sluice-kernels`. Where they cannot be built or loaded (no compiler, a foreign
platform) the engine runs the plain torch ops instead and says so in its log:
`kernels()` answers None and callers keep their torch path. SLUICE_CPU_KERNELS=0 turns
them off, to measure the difference or to rule them out.

    python -m engine.cpu_kernels     # build now (what `make install` runs)
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# -march=native: built on the machine that runs it. fp-contract off: see the source's header.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


def build_directory() -> Path:
    return Path(sys.prefix) / "sluice-kernels"


def enabled() -> bool:
    return os.environ.get("SLUICE_CPU_KERNELS", "1").lower() not in ("0", "off", "false", "no")


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled module, or None (logged once) where it cannot be had."""
    if not enabled():
        log.info("CPU kernels off (SLUICE_CPU_KERNELS); using plain torch ops")
        return None
    try:
        return _load(verbose=False)
    except Exception as exc:  # a missing compiler, headers, or a failed build
        log.warning("CPU kernels unavailable, using plain torch ops: %s", exc)
        return None


def _load(verbose: bool) -> ModuleType:
    from torch.utils.cpp_extension import load

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    return load(
        name="sluice_cpu_kernels",
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
        verbose=verbose,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    _load(verbose=False)
    print(f"CPU kernels built in {build_directory()}")
