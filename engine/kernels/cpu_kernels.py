"""The engine's own CPU kernels (engine/kernels/csrc/cpu_kernels.cpp): fused RMSNorm, RoPE and
SiLU-and-mul, a paged decode attention that reads the KV cache in place, and a linear over
a GGUF checkpoint's own Q4_1/Q8_0, Q4_K/Q5_K/Q6_K and MXFP4 blocks.

They are compiled for the CPU they run on, once (`make install` does it; otherwise the first
engine that wants them does, under a file lock), with the system C++ compiler and the
`ninja` package, into `<venv>/sluice-kernels` (or `~/.cache/sluice/kernels` where the venv
is read-only, as in the container images). The module name carries a fingerprint of the
CPU's features, of the source and of the ISA it targets, so a venv shared by machines with
other CPUs (or checkouts with other sources) never loads code built for something else.
Where the kernels cannot be built or loaded (no compiler) the engine runs the plain torch
ops and says so in its log: `kernels()` answers None and callers keep their torch path.
SLUICE_CPU_KERNELS=0 turns them off, to measure the difference or to rule them out.
Float32 rows over Q4_1/Q8_0 blocks take the linear's int16 path (x rounded to int16 per
group of 4 values, 2^-16 of the group's largest, then integer dot products: faster, not
bit-exact) up to 2 rows by default; SLUICE_CPU_INT16_ROWS=N sets the row count, 0 turns it
off (engine/layers/cpu_ops.py INT16_X_MAX_ROWS, docs/benchmarks.md).

Their hot loops have an AVX-512 path and an AVX2+FMA one (the module's `simd` says which
it was built with), scalar code elsewhere. SLUICE_CPU_ISA=avx2 makes this machine behave
as an AVX2-only CPU (AMD Zen 3, older Intel): the kernels are built for x86-64-v3 (AVX2,
FMA, F16C; no AVX-512), and `--dtype auto` picks float32 as it does there
(engine/process/device.py). Every machine can so run the path that machine kind runs; `native`
(the default) targets the CPU itself. `kernels_for(isa)` loads either build (the tests
run both where the CPU can).

    python -m engine.kernels.cpu_kernels     # build now (what `make install` runs)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
# Built for the machine that runs it (or, with SLUICE_CPU_ISA=avx2, for the AVX2-only subset
# of it). fp-contract off: see the source's header.
BASE_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
ISA_MARCH = {"native": "-march=native", "avx2": "-march=x86-64-v3"}


def target_isa() -> str:
    """The instruction set the kernels are built for: `native` or `avx2` (SLUICE_CPU_ISA)."""
    isa = os.environ.get("SLUICE_CPU_ISA", "native").strip().lower() or "native"
    if isa not in ISA_MARCH:
        raise ValueError(f"SLUICE_CPU_ISA={isa!r}: expected one of {', '.join(ISA_MARCH)}")
    return isa


# The /proc/cpuinfo flags each ISA's build needs (x86-64-v3's, less the ones every x86-64
# CPU with AVX2 has); `native` is whatever this CPU has.
ISA_CPU_FLAGS = {"native": (), "avx2": ("avx2", "fma", "f16c", "bmi2", "movbe")}


def cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((line for line in lines if line.startswith("flags")), "").split())


def cpu_runs(isa: str) -> bool:
    """Whether this CPU can run code built for `isa` (tests skip the ISAs it cannot)."""
    return all(flag in cpu_flags() for flag in ISA_CPU_FLAGS[isa])


def cflags(isa: str | None = None) -> list[str]:
    return [*BASE_CFLAGS, ISA_MARCH[isa or target_isa()]]


def build_directory() -> Path:
    in_venv = Path(sys.prefix) / "sluice-kernels"
    if os.access(sys.prefix, os.W_OK) or in_venv.is_dir() and os.access(in_venv, os.W_OK):
        return in_venv
    return Path.home() / ".cache" / "sluice" / "kernels"


def cpu_fingerprint() -> str:
    """A short hash of the CPU model and feature flags (Linux), "generic" elsewhere."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "generic"
    wanted = [line for line in lines if line.startswith(("flags", "model name"))][:2]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:10]


def module_name(isa: str | None = None) -> str:
    """One name per (CPU, source, ISA): builds for other sources or targets never collide."""
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8]
    return f"sluice_cpu_kernels_{cpu_fingerprint()}_{isa or target_isa()}_{source}"


def enabled() -> bool:
    return os.environ.get("SLUICE_CPU_KERNELS", "1").lower() not in ("0", "off", "false", "no")


def kernels() -> ModuleType | None:
    """The compiled module the engine uses (SLUICE_CPU_ISA's build), or None (logged once)
    where it cannot be had or SLUICE_CPU_KERNELS turns it off."""
    if not enabled():
        _log_off()
        return None
    return kernels_for(target_isa())


@functools.cache
def _log_off() -> None:
    log.info("CPU kernels off (SLUICE_CPU_KERNELS); using plain torch ops")


@functools.cache
def kernels_for(isa: str) -> ModuleType | None:
    """The module built for `isa` ("native" or "avx2"), built on first use; None (logged)
    where it cannot be built. The tests load both builds to check both paths on one CPU."""
    if isa not in ISA_MARCH:
        raise ValueError(f"unknown ISA {isa!r}: expected one of {', '.join(ISA_MARCH)}")
    try:
        return _load(isa)
    except Exception as exc:  # a missing compiler, headers, or a failed build
        log.warning("CPU kernels unavailable, using plain torch ops: %s", exc)
        return None


# torch's loader serializes builds with a lock file it creates and deletes; a build that is
# killed leaves that file behind, and every later build waits on it forever. Builds here first
# take an flock on a file of our own, which the OS releases when its holder dies however it
# dies: whoever holds it is the only builder, so a torch lock file found then is abandoned.
TORCH_LOCK = "lock"
BUILD_FLOCK = "build.flock"


@contextlib.contextmanager
def build_lock(directory: Path):
    """Be the only process building into `directory`, and clear a killed build's lock file."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / BUILD_FLOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another live process builds
        try:
            (directory / TORCH_LOCK).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load(isa: str) -> ModuleType:
    import torch  # noqa: F401  (the module links libtorch: load it first)

    name = module_name(isa)
    directory = build_directory()
    built = directory / f"{name}.so"
    if built.is_file():
        # Up to date: import it directly. torch's loader would take the build lock and run
        # ninja in every engine process that starts.
        spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return _build(name, directory, isa)


def _build(name: str, directory: Path, isa: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    # The `ninja` package installs its binary beside this interpreter, which a venv's
    # python does not put on PATH by itself; torch looks for `ninja` on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    with build_lock(directory):
        return load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=cflags(isa),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    module = _build(module_name(), build_directory(), target_isa())
    print(f"CPU kernels built: {module.__file__}")
