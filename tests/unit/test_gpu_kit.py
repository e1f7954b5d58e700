"""The GPU check kit (benchmarks/gpukit, docs/gpu.md), checked here since CI has no GPU:
the dry run of the real plan and carried folder, the checks it is made of, and the device
driver's handling of steps (timeouts kill the step's processes, a failed step skips those
that need it, the summary is written as it goes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpukit import plan as kit
from benchmarks.gpukit import wheels as carried

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the whole kit's dry run, a model build included: ~15 s
def test_dry_run_passes():
    """The one command's --dry-run, as CI runs it: the plan fits 540 s and 8 files, the
    device's unit tests collect there, the carried size fits, every module sluice imports
    is on the device or carried, and the model builds (2 of its layers, for time) and loads
    with the default model's shape. Where .gpukit/ is built, its
    wheels and kernels are checked too; where not, the output says those were skipped."""
    env = os.environ | {"PYTHON": sys.executable}
    done = subprocess.run([str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run",
                           "--model-layers", "2"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line[:1].isalpha()]
    assert [line.split()[0] for line in lines[:4]] == ["ok"] * 4, done.stdout
    assert any(line.startswith("ok       model builds (2 layers)") for line in lines)
    for name in ("wheels", "prebuilt FlashInfer kernels", "tokenizer"):
        (line,) = [line for line in lines if name in line]
        assert line.startswith("ok") or ".gpukit/ is not built" in line, line


# ---------------------------------------------------------------- the plan's checks


def paths(tmp_path) -> kit.Paths:
    return kit.Paths(repo=ROOT, out=tmp_path / "out", site=tmp_path / "site",
                     model=tmp_path / "model")


def test_the_real_plan_fits(tmp_path):
    plan = kit.steps(sys.executable, paths(tmp_path), ["a.whl"])
    assert kit.problems(plan) == []
    assert sum(s.timeout_s for s in plan) + kit.DRIVER_MARGIN_S <= kit.DEVICE_BUDGET_S == 540
    assert len(kit.result_files(plan)) <= kit.MAX_RESULT_FILES == 8
    assert [s.name for s in plan][-3:] == ["bench", "offline b1", "offline b64"]


def step(name, timeout_s=10, log="a.log", needs=(), results=()):
    return kit.Step(name, ["true"], timeout_s, log, needs, results)


def test_plan_over_budget_is_reported():
    at_limit = [step("a", kit.DEVICE_BUDGET_S - kit.DRIVER_MARGIN_S)]
    assert kit.problems(at_limit) == []
    (problem,) = kit.problems([step("a", kit.DEVICE_BUDGET_S - kit.DRIVER_MARGIN_S + 1)])
    assert "over 540 s" in problem


def test_too_many_or_nested_result_files_are_reported():
    seven = [step(str(i), log=f"{i}.log") for i in range(7)]  # + summary.txt = 8
    assert kit.problems(seven) == []
    (problem,) = kit.problems(seven + [step("x", log="x.log")])
    assert "9 result files, over 8" in problem
    (problem,) = kit.problems([step("a", results=("deep/file.json",))])
    assert "deep/file.json" in problem


def test_a_need_that_runs_later_is_reported():
    assert kit.problems([step("a"), step("b", needs=("a",))]) == []
    (problem,) = kit.problems([step("b", needs=("a",)), step("a")])
    assert problem == "b needs a, which does not run before it"


# ---------------------------------------------------------------- the wheels' checks


def fake_wheel(folder: Path, name: str, version: str, requires=()) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as archive:
        meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
        archive.writestr(f"{dist}.dist-info/METADATA", f"Name: {name}\n{meta}")


def carried_folder(tmp_path: Path, skip=(), extra=()) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name, version in carried.CARRIED.items():
        if name not in skip:
            fake_wheel(folder, name, version)
    for name, version, requires in extra:
        fake_wheel(folder, name, version, requires)
    return folder


def test_the_carried_set_is_complete(tmp_path):
    pyproject = ROOT / "pyproject.toml"
    assert carried.problems(carried_folder(tmp_path), pyproject) == []


def test_a_missing_or_doubled_wheel_is_reported(tmp_path):
    folder = carried_folder(tmp_path, skip=("msgspec",),
                            extra=[("gguf", "0.18.0", ())])
    issues = carried.problems(folder, ROOT / "pyproject.toml")
    assert "msgspec: want one wheel of 0.23.0, found none" in issues
    assert "gguf: want one wheel of 0.19.0, found ['0.18.0', '0.19.0']" in issues
    # msgspec is one of sluice's own needs, and the device lacks it.
    assert "msgspec (needed by sluice) is neither on the device nor carried" in issues


def test_an_extra_sluice_asks_for_is_resolved(tmp_path):
    """pyproject asks for uvicorn[standard], and the frontend runs uvicorn's httptools
    parser: the extra's needs count, under the device's markers (no Windows colorama)."""
    folder = carried_folder(tmp_path, skip=("uvicorn", "httptools"), extra=[
        ("uvicorn", carried.CARRIED["uvicorn"],
         ("h11>=0.8", "httptools>=0.8.0; extra == 'standard'",
          "colorama>=0.4; sys_platform == 'win32' and extra == 'standard'"))])
    issues = carried.problems(folder, ROOT / "pyproject.toml")
    assert issues == [
        "httptools: want one wheel of 0.9.0, found none",
        "httptools (needed by uvicorn[standard]) is neither on the device nor carried"]


def test_a_need_neither_on_the_device_nor_carried_is_reported(tmp_path):
    folder = carried_folder(tmp_path, extra=[
        ("extra-thing", "1.0", ("numpy>=1", "left-pad; extra == 'dev'", "right-pad (>=2)"))])
    issues = carried.problems(folder, ROOT / "pyproject.toml")
    assert issues == ["extra-thing: a wheel that is not in CARRIED",
                      "right-pad (needed by extra-thing) is neither on the device nor carried"]


def test_an_import_of_a_package_the_device_lacks_is_reported(monkeypatch):
    assert carried.imports_not_on_device(ROOT) == []
    monkeypatch.setattr(carried, "CARRIED",
                        {k: v for k, v in carried.CARRIED.items() if k != "msgspec"})
    assert carried.imports_not_on_device(ROOT) == [
        "module msgspec (msgspec) is neither on the device nor carried"]


# ---------------------------------------------------------------- the device driver


@pytest.fixture
def fake_plan(monkeypatch, tmp_path):
    """kit.steps replaced by quick commands: one passes, one fails, one outlives its
    timeout, two of them leaving a child process behind, and steps that need them."""
    marker = tmp_path / "child-alive"

    def leaves_a_child(then: str) -> list[str]:
        child = f"import time, pathlib; time.sleep(3); pathlib.Path(r'{marker}').touch()"
        return [sys.executable, "-c", f"import subprocess, sys, time; "
                f"subprocess.Popen([sys.executable, '-c', {child!r}]); {then}"]

    steps = [
        kit.Step("good", leaves_a_child("print('hello')"), 20, "a.log"),
        kit.Step("bad", [sys.executable, "-c", "raise SystemExit(3)"], 20, "a.log"),
        kit.Step("slow", leaves_a_child("time.sleep(60)"), 1, "b.log"),
        kit.Step("after bad", ["true"], 5, "b.log", needs=("good", "bad")),
        kit.Step("after good", ["true"], 5, "b.log", needs=("good",)),
    ]
    monkeypatch.setattr(kit, "steps", lambda python, paths, wheels, layers: steps)
    return marker


def test_run_times_out_kills_skips_and_summarizes(fake_plan, tmp_path):
    from benchmarks.gpukit.__main__ import run

    out = tmp_path / "out"
    assert run(out) == 1
    summary = (out / kit.SUMMARY).read_text().splitlines()
    status = {line[:12].strip(): line[12:].split("  ")[0].strip() for line in summary}
    assert status == {"good": "ok", "bad": "FAIL (exit 3)", "slow": "TIMEOUT after 1 s",
                      "after bad": "skipped (bad did not pass)", "after good": "ok"}
    assert "hello" in (out / "a.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["a.log", "b.log", kit.SUMMARY]
    # Killed with their steps: gone now, not 3 s from now when they would leave the marker
    # (waiting those out cost every run 4 s). A zombie's cmdline is empty.
    deadline = time.monotonic() + 1
    while _running_with(str(fake_plan)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running_with(str(fake_plan)), "a step's child outlived it"
    assert not fake_plan.exists(), "a step's child outlived it"


def _running_with(text: str) -> list[int]:
    """The live processes whose command line holds `text`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found
