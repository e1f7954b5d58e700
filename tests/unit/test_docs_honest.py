"""README.md and docs/ name only flags and routes that exist, and name every one that does
(issue 41). A flag or route added, renamed or dropped on one side and not the other fails
here, naming the file and line. The snippets themselves run in
tests/integration/test_docs_snippets.py."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace

from shared.config import FrontendConfig
from sluice import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
SCRIPT = re.compile(r"(?:benchmarks/)?([\w-]+\.(?:py|sh))")

# Flags the docs name that belong to other programs, each with whose it is. Keep it small:
# a sluice flag never belongs here.
OTHER_PROGRAMS_FLAGS = {
    "--build": "docker compose's and cmake's",
    "--build-arg": "docker build's",
    "--no-binary": "pip's",
    "--no-deps": "pip's",
    "--no-index": "pip's (the GPU kit's install step)",
    "--target": "cmake's",
    "--replicas": "kubectl scale's",
    "--scale": "docker compose's",
    "--no-repack": "llama-server's (the llama.cpp comparison)",
    "--allowed-media-domains": "vLLM's, named as having no counterpart here",
    "--nproc-per-node": "torchrun's (docs/operations.md, Tensor parallelism)",
    "--rm": "docker run's (docs/observability.md, a trace collector in one command)",
}
# Benchmark script flags named in prose, away from the script's command line.
PROSE_SCRIPT_FLAGS = {"--shared-system": "benchmarks/prefix_routing.py",
                      "--clock": "benchmarks/profile_decode.py"}

# Paths in backticks or URLs that are not routes of the frontend.
NOT_ROUTES = {
    "/v1": "the OpenAI base URL clients are given",
    "/tmp": "a directory",
    "/tmp/sluice-gpu-site": "a directory on the GPU machine (docs/gpu.md)",
    "/tmp/sluice-gpu-model": "a directory on the GPU machine (docs/gpu.md)",
    "/v1/traces": "a trace collector's OTLP/HTTP path (docs/observability.md)",
}
METHODS = r"(?:(?:GET|POST|DELETE)(?:\|(?:GET|POST|DELETE))* )?"
ROUTE_SPAN = re.compile(rf"`{METHODS}(/[\w{{}}./-]*\w[\w{{}}./-]*)`")
LOCAL_URL = re.compile(r"https?://(?:127\.0\.0\.1|localhost)(?::\d+)?(/[\w{}./-]*)")


def _mentions(pattern: re.Pattern, group: int = 0):
    """(match, line, where) for every match in README.md and docs/."""
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                yield m[group], line, f"{doc.relative_to(ROOT)}:{number}"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _sluice_flags() -> set[str]:
    return {o for sub in _subparsers().values() for a in sub._actions
            for o in a.option_strings if o.startswith("--")}


def _benchmark_script(line: str) -> Path | None:
    """The benchmarks/ script a line runs or names, if any."""
    for name in SCRIPT.findall(line):
        if (ROOT / "benchmarks" / name).is_file():
            return ROOT / "benchmarks" / name
    return None


def _not_accepted_vllm_flags() -> set[str]:
    """docs/vllm-flags.md's rows marked "not accepted" (test_vllm_flags_doc checks those)."""
    row = re.compile(r"^\| `(--[a-z0-9-]+)`.*\| not accepted \|")
    text = (ROOT / "docs" / "vllm-flags.md").read_text()
    return {m[1] for m in map(row.match, text.splitlines()) if m}


def test_every_flag_the_docs_name_exists():
    ours, absent = _sluice_flags(), _not_accepted_vllm_flags()
    wrong = []
    for flag, line, where in _mentions(FLAG):
        flag = flag.replace("_", "-")  # vLLM's spelling, which the CLI takes too
        script = _benchmark_script(line)
        if script:  # a benchmark script's command line: its own flags
            if flag not in script.read_text():
                wrong.append(f"{where}: {flag} is not a flag of {script.name}")
        elif flag in PROSE_SCRIPT_FLAGS:
            assert flag in (ROOT / PROSE_SCRIPT_FLAGS[flag]).read_text(), flag
        elif flag not in ours and flag not in absent and flag not in OTHER_PROGRAMS_FLAGS:
            wrong.append(f"{where}: {flag} is no flag of any sluice command")
    assert not wrong, "\n".join(wrong)


def test_every_flag_is_in_the_docs():
    named = {flag.replace("_", "-") for flag, _, _ in _mentions(FLAG)}
    missing = sorted(_sluice_flags() - named)
    assert not missing, f"flags `sluice --help` lists that README.md and docs/ never name: " \
                        f"{missing}"


def test_the_allow_lists_hold_no_sluice_flag():
    assert not _sluice_flags() & set(OTHER_PROGRAMS_FLAGS)


def _route_table() -> set[str]:
    from frontend.http.app import build_app

    ctx = SimpleNamespace(client=SimpleNamespace(engine_alive=False, stats=None),
                          model_name="m", vocab_size=49152)
    # Every route a flag can open counts (the LoRA routes need --allow-runtime-lora-updating).
    config = FrontendConfig(model="m", served_model_name="m", engine_address="tcp://x:1",
                            allow_runtime_lora_updating=True)
    return {_shape(route.path) for route in build_app(ctx, config).routes}


def _shape(path: str) -> str:
    """`/v1/models/{model_id:path}` and `/v1/models/{model}` alike: `/v1/models/{}`."""
    return re.sub(r"\{[^}]*\}", "{}", path.rstrip("/") or "/")


def _doc_routes() -> dict[str, str]:
    routes = {}
    for pattern in (ROUTE_SPAN, LOCAL_URL):
        for path, _, where in _mentions(pattern, 1):
            routes.setdefault(_shape(path), where)
    return routes


def test_every_route_the_docs_name_is_served():
    table = _route_table()
    wrong = [f"{where}: {path} is not in the route table (frontend/http/app.py)"
             for path, where in _doc_routes().items()
             if path not in table and path not in NOT_ROUTES]
    assert not wrong, "\n".join(wrong)


def test_every_route_is_in_the_docs():
    missing = sorted(_route_table() - set(_doc_routes()))
    assert not missing, f"routes README.md and docs/ never name: {missing}"


def test_the_open_routes_are_routes():
    from shared.config import OPEN_PATHS

    assert set(OPEN_PATHS) <= _route_table()


def test_not_routes_are_not_routes():
    assert not _route_table() & set(NOT_ROUTES)


# Neither FlashInfer nor NCCL tensor parallelism has run on a GPU yet (docs/gpu.md): every
# doc that names them says so, and README in each section that does. Drop this test with
# the caveats once benchmarks/gpu_check.sh's results (and a two-GPU run) are recorded.
GPU_PATHS = re.compile(r"flashinfer|nccl", re.IGNORECASE)
NOT_RUN_ON_A_GPU = re.compile(r"(?:not yet run|untested) on a GPU|has run on a GPU yet",
                              re.IGNORECASE)


def _unflagged_gpu_claims(text: str, per_section: bool) -> list[str]:
    """The first line of each part of `text` (each `##` section, or the whole) that names
    FlashInfer or NCCL without saying it has not run on a GPU."""
    parts = re.split(r"(?m)^## ", text) if per_section else [text]
    return [part.splitlines()[0] for part in parts
            if GPU_PATHS.search(part) and not NOT_RUN_ON_A_GPU.search(" ".join(part.split()))]


def test_every_doc_naming_flashinfer_or_nccl_says_neither_has_run_on_a_gpu():
    unflagged = {f"{doc.relative_to(ROOT)}: {where}" for doc in DOCS
                 for where in _unflagged_gpu_claims(doc.read_text(), doc.name == "README.md")}
    assert not unflagged, unflagged
