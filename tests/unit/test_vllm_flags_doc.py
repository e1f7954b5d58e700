"""docs/vllm-flags.md says true things about the parser (issue 19)."""

from __future__ import annotations

import re
from pathlib import Path

from sluice import cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-flags.md"
ROW = re.compile(r"^\| `(--[a-z0-9-]+)`(?: \(`(-[a-z]+)`\))? \| ([a-z -]+) \|(.*)\|$")


def _rows() -> dict[str, tuple[str | None, str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m[1] not in rows, f"{m[1]} listed twice"
            rows[m[1]] = (m[2], m[3], m[4].strip())
    assert len(rows) > 60
    return rows


def _serve_options() -> dict[str, object]:
    parser = cli.build_parser()
    [sub] = [a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)]
    return {o: a for a in sub.choices["serve"]._actions for o in a.option_strings}


def test_every_row_matches_the_parser():
    options = _serve_options()
    for flag, (short, status, here) in _rows().items():
        assert status in {"same", "alias", "no-op", "fails", "not accepted"}, flag
        if status == "not accepted":
            assert flag not in options, f"{flag} is accepted now: update docs/vllm-flags.md"
            continue
        assert flag in options, f"docs/vllm-flags.md says {flag} is accepted"
        if short:
            assert options[short] is options[flag], f"{short} is not {flag}"
        if status == "alias":
            ours = re.match(r"`(--[a-z-]+)`", here)[1]
            assert options[ours] is options[flag], f"{flag} is not an alias of {ours}"
        if status == "no-op":
            assert flag in cli.VLLM_NOOP_FLAGS
        if status == "fails":
            assert flag in cli.VLLM_UNSUPPORTED_FLAGS


def test_every_noop_and_failing_flag_is_in_the_table():
    rows = _rows()
    for flag in cli.VLLM_NOOP_FLAGS:
        assert rows[flag][1] == "no-op", flag
    for flag in cli.VLLM_UNSUPPORTED_FLAGS:
        assert rows[flag][1] == "fails", flag
