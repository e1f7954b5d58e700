"""The engine's OpenMP threads sleep while they wait (engine/__init__.py), unless the user
chose otherwise: libgomp reads the setting once, so it must be in place before torch loads."""

import os
import subprocess
import sys

PROBE = "import engine, os; print(os.environ.get('OMP_WAIT_POLICY'))"


def _policy(env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return out.stdout.strip()


def test_the_engine_waits_passively_unless_told_otherwise():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy(env) == "PASSIVE"
    assert _policy(env | {"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


def test_no_engine_entry_point_imports_torch_before_the_policy_is_set():
    """`python -m sluice` imports the CLI of every tier; torch must not be among them, or
    libgomp would have read its settings before engine/__init__ ran."""
    probe = "import sluice.cli, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
