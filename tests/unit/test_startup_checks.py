"""The first hour (issue 41): a start-up mistake is one line naming the flag, before anything
loads; `--help` states every default from the flag's own value; errors print the
subcommand's usage."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared import startup_checks
from shared.config import OPEN_PATHS
from shared.startup_checks import StartupError
from sluice import cli

ROOT = Path(__file__).resolve().parents[2]


def _sluice(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "sluice", *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("argv, env, says", [
    (["serve", "--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""},
     "--device cuda: torch sees no CUDA device"),
    (["engine", "--device", "tpu"], {}, "--device tpu: not a device"),
    (["serve", "--chat-template", "notafile"], {},
     "--chat-template notafile: no such file, and no Jinja text either"),
    (["serve", "--model", "no/such/thing.gguf"], {}, "--model no/such/thing.gguf: model path"),
    (["frontend", "--tokenizer", "./nowhere"], {}, "--tokenizer ./nowhere: model path"),
    (["serve", "--batch-invariant"], {"SLUICE_CPU_KERNELS": "0"},
     "SLUICE_CPU_KERNELS=0 switches off"),
    (["engine"], {"SLUICE_CPU_ISA": "avx9"}, "SLUICE_CPU_ISA='avx9': expected one of native"),
    (["serve"], {"SLUICE_CPU_ISA": "AVX2 extra"}, "SLUICE_CPU_ISA='avx2 extra'"),
])
def test_a_mistake_is_one_line_naming_the_flag_before_anything_loads(argv, env, says):
    started = time.monotonic()
    done = _sluice(*argv, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("sluice: ") and says in lines[0], lines
    assert "Traceback" not in done.stderr + done.stdout
    assert time.monotonic() - started < 60  # the model load alone took ~20 s on this host


def test_a_taken_port_is_named():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        args = cli.parse_args(["frontend", "--port", str(port)])
        with pytest.raises(StartupError, match=f"--port {port}: cannot listen there"):
            startup_checks.check_listen_address(args)


def test_every_check_of_the_frontend_runs_in_the_one_pass(tmp_path):
    for argv, says in [(["--ssl-keyfile", str(tmp_path / "k")], "needs both"),
                       (["--root-path", "llm/"], "--root-path"),
                       (["--allowed-local-media-path", str(tmp_path / "no")], "no such folder"),
                       (["--generation-config", str(tmp_path / "no")], "not a folder")]:
        with pytest.raises(SystemExit, match=says) as e:
            cli.check_startup(cli.parse_args(["serve", *argv]))
        assert str(e.value).startswith("sluice: ")
    cli.check_startup(cli.parse_args(["serve", "--port", "0", "--device", "cpu"]))


def _actions():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                yield name, sub, action


def test_help_states_every_default_from_the_flag_itself():
    for name, sub, action in _actions():
        text = sub._get_formatter()._expand_help(action) if action.help else ""
        flag = action.option_strings[-1]
        if action.default not in (None, False, [], "", argparse.SUPPRESS):
            assert "default" in text or "%(default)" in (action.help or ""), \
                f"sluice {name} {flag}: help states no default"
        # A bare number stated as the default must be the flag's own (`32 MiB` is words).
        stated = re.search(r"default: (-?[0-9.]+)(?=[),;]|$)", text)
        if stated and not isinstance(action.default, str):
            assert float(stated[1]) == float(action.default), f"sluice {name} {flag}"


def test_every_flag_has_help():
    bare = [f"{name} {action.option_strings[-1]}" for name, _, action in _actions()
            if not action.help]
    assert not bare, bare


def test_api_key_help_names_every_open_route():
    [(sub, action)] = [(sub, action) for name, sub, action in _actions()
                       if name == "serve" and "--api-key" in action.option_strings]
    text = sub._get_formatter()._expand_help(action)
    assert all(path in text for path in OPEN_PATHS), text


def test_a_refused_vllm_flag_prints_the_subcommands_usage():
    for argv, says in [(["serve", "--cpu-offload-gb", "4"],
                        "sluice has no offloading weights to CPU memory"),
                       (["engine", "--no-such-flag"], "unrecognized arguments: --no-such-flag")]:
        done = _sluice(*argv)
        assert done.returncode == 2
        assert done.stderr.startswith(f"usage: sluice {argv[0]} ")
        assert f"sluice {argv[0]}: error: " in done.stderr and says in done.stderr


@pytest.mark.parametrize("flag, bad, good", [
    ("--port", ["-1", "65536", "80.5"], ["0", "65535"]),
    ("--page-size", ["0", "x"], ["1"]),
    ("--max-num-batched-tokens", ["0"], ["1"]),
    ("--max-num-seqs", ["0"], ["1"]),
    ("--tokenizer-threads", ["0"], ["1"]),
    ("--threads", ["0"], ["1"]),
    ("--num-kv-pages", ["0"], ["1"]),
    ("--max-model-len", ["0"], ["1"]),
    ("--postproc-workers", ["-1"], ["0"]),
    ("--max-stored-responses", ["-1"], ["0"]),
    ("--responses-ttl", ["-1", "inf", "x"], ["0", "60"]),
    ("--max-stored-bytes", ["1023"], ["1024"]),
    ("--max-conversation-items", ["0"], ["1"]),
    ("--conversation-ttl", ["-1", "inf", "x"], ["0", "60"]),
    ("--max-request-body-bytes", ["0"], ["1"]),
    ("--max-queued-requests", ["0"], ["1"]),
    ("--kv-cache-memory-gb", ["0", "-1", "nan", "inf"], ["0.001"]),
    ("--gpu-memory-utilization", ["0", "1.01", "nan"], ["0.01", "1"]),
    ("--render-timeout", ["0", "inf"], ["0.1"]),
    ("--request-timeout", ["0", "-1"], ["0.1"]),
    ("--shutdown-timeout", ["-1", "inf"], ["0"]),
])
def test_numbers_no_process_could_run_with_stop_the_parse(flag, bad, good, capsys):
    for value in bad:
        with pytest.raises(SystemExit):
            cli.parse_args(["serve", f"{flag}={value}"])
        assert f"argument {flag}" in capsys.readouterr().err
    for value in good:
        cli.parse_args(["serve", f"{flag}={value}"])
