"""What the device run does, in order, each step under its own timeout, and where its output
goes: the one place for the check's time budget and its result files.

The device call runs `timeout 540 benchmarks/gpu_check.sh` (a command may run 600 s; the
rest is margin for the machine's start and the transfers), so the steps' timeouts must add
up to under DEVICE_BUDGET_S: `--dry-run` checks that, and tests/unit/test_gpu_kit.py runs it.
Standard library only: this runs on the device before the carried wheels are installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEVICE_BUDGET_S = 540  # `timeout 540` around the whole script
# The driver itself: starting python, the summary, a timed-out step's 3 s to stop.
DRIVER_MARGIN_S = 10
CARRY_LIMIT_MIB = 60  # checkout + .gpukit together (the device tool takes 64)
MAX_RESULT_FILES = 8  # what comes back from $OUT, each directly under it

KIT = Path(".gpukit")  # carried, gitignored; built by `python -m benchmarks.gpukit prepare`
WHEELS = KIT / "wheels"
KERNELS = KIT / "kernels"  # holds the flashinfer_jit_cache package
TOKENIZER = KIT / "tokenizer"

SUMMARY = "summary.txt"
BENCH_CONCURRENCY = (1, 64)
OFFLINE_BATCHES = BENCH_CONCURRENCY  # the engine in process, at the same batch sizes

# CPU unit tests of the code the CUDA path shares (page tables, sampling, KV pages) that
# import nothing the device lacks (no test-only packages, no bundled GGUF) and compile no
# CPU kernels: under the device's torch. The rest of tests/unit is CI's.
DEVICE_UNIT_TESTS = (
    "tests/unit/test_flashinfer_metadata.py",
    "tests/unit/test_sampler.py",
    "tests/unit/test_kv_cache.py",
)


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    log: str  # a file directly under $OUT; steps may share one (appended)
    needs: tuple[str, ...] = ()  # steps that must have passed first, else this is skipped
    results: tuple[str, ...] = ()  # further files under $OUT it writes itself


@dataclass(frozen=True)
class Paths:
    """Where things live on the device: the checkout, the results, the installed wheels and
    the built model (the last two outside $OUT, which comes back)."""

    repo: Path
    out: Path
    site: Path
    model: Path


def steps(python: str, paths: Paths, wheels: list[str], layers: int | None = None
          ) -> list[Step]:
    """layers: build the model with fewer layers than the default's 30, where time demands."""
    out = paths.out
    model = str(paths.model)
    gpu_tests_s = 215
    return [
        Step("install", [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--no-compile", "--no-cache-dir", "--upgrade", "--target",
                         str(paths.site), *wheels], 45, "setup.log"),
        Step("model", [python, "-m", "benchmarks.gpukit.model", model,
                       "--tokenizer", str(paths.repo / TOKENIZER),
                       *(["--layers", str(layers)] if layers else [])], 45, "setup.log"),
        Step("environment", [python, "-m", "benchmarks.gpukit.environment"], 40, "setup.log",
             needs=("install",)),
        Step("unit tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-m", "not slow", *DEVICE_UNIT_TESTS], 40, "unit.log",
             needs=("install",)),
        Step("gpu tests", [python, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
                           f"--timeout={gpu_tests_s - 10}", "tests/gpu"], gpu_tests_s,
             "gpu-tests.log", needs=("install", "model")),
        Step("bench", [python, "-m", "benchmarks.gpukit.serve_bench", "--model", model,
                       "--json", str(out / "bench.json"), "--server-log",
                       str(out / "serve.log"),
                       "--concurrency", *map(str, BENCH_CONCURRENCY)], 85, "bench.log",
             needs=("install", "model"), results=("bench.json", "serve.log")),
        # One process per batch size: an engine sizes its KV cache from the GPU memory free.
        *(Step(f"offline b{batch}", [python, "benchmarks/profile_decode.py", "--model", model,
                                     "--device", "cuda", "--batch", str(batch),
                                     "--steps", "64"], 30, "offline.log",
               needs=("install", "model")) for batch in OFFLINE_BATCHES),
    ]


def result_files(plan: list[Step]) -> set[str]:
    return {SUMMARY} | {s.log for s in plan} | {f for s in plan for f in s.results}


def problems(plan: list[Step]) -> list[str]:
    """Why this plan would not fit the device call; [] when it does."""
    issues = []
    total = sum(s.timeout_s for s in plan)
    if total + DRIVER_MARGIN_S > DEVICE_BUDGET_S:
        issues.append(f"the steps' timeouts add up to {total} s, plus {DRIVER_MARGIN_S} s for "
                      f"the driver: over {DEVICE_BUDGET_S} s")
    files = result_files(plan)
    if len(files) > MAX_RESULT_FILES:
        issues.append(f"{len(files)} result files, over {MAX_RESULT_FILES}: {sorted(files)}")
    for name in files:
        if "/" in name or not name.replace(".", "").replace("-", "").replace("_", "").isalnum():
            issues.append(f"result file {name!r} is not a plain name directly under $OUT")
    names = [s.name for s in plan]
    for step in plan:
        for need in step.needs:
            if need not in names[: names.index(step.name)]:
                issues.append(f"{step.name} needs {need}, which does not run before it")
    return issues
