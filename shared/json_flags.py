"""Flags whose value is one JSON object (`--pooler-config`, `--hf-overrides`,
`--override-generation-config`, `--default-chat-template-kwargs`): read in one place, so each
refuses text that is not JSON, or JSON that is not an object, in the same words.

It sits below `shared/command_line.py` because the checks that read these flags
(`shared/runner_config.py`, `shared/generation_config.py`) run in the engine and the frontend
as well as on the command line.
"""

from __future__ import annotations

import json


def json_object(text: str, flag: str | None = None) -> dict:
    """`text` as a JSON object; ValueError saying what is wrong, after `flag`'s name when
    given (argparse puts the flag's name in front of its type's message itself)."""
    where = f"{flag}: " if flag else ""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}must be a JSON object")
    return value
