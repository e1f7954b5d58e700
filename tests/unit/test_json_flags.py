"""Flags whose value is a JSON object refuse bad text in one wording (shared/json_flags.py),
whichever check reads them: the engine's and frontend's (a ValueError naming the flag) or
argparse's (which names the flag itself)."""

from __future__ import annotations

import argparse
import re

import pytest

from shared.command_line import json_object
from shared.generation_config import load_generation_defaults
from shared.runner_config import parse_hf_overrides, parse_pooler_config
from sluice import cli


@pytest.mark.parametrize("text, says", [("{", "not JSON: "), ("[1]", "must be a JSON object$")])
def test_every_json_object_flag_refuses_in_the_same_words(tmp_path, text, says):
    checks = {
        "--pooler-config": parse_pooler_config,
        "--hf-overrides": parse_hf_overrides,
        "--override-generation-config": lambda t: load_generation_defaults(
            str(tmp_path), "vllm", t),
    }
    for flag, check in checks.items():
        with pytest.raises(ValueError, match=f"^{re.escape(flag)}: {says}"):
            check(text)
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{says}"):
        json_object(text)


def test_a_json_object_flag_gives_the_object():
    assert json_object('{"enable_thinking": false}') == {"enable_thinking": False}


@pytest.mark.parametrize("command", ["engine", "frontend", "serve"])
@pytest.mark.parametrize("flag", ["--pooler-config", "--hf-overrides"])
def test_the_command_line_refuses_a_bad_pooling_flag(command, flag, capsys):
    """Checked as the flags are parsed (shared.command_line), before any process starts."""
    with pytest.raises(SystemExit):
        cli.parse_args([command, flag, "[1]"])
    assert f"argument {flag}: {flag}: must be a JSON object" in capsys.readouterr().err
