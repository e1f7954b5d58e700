"""Reading calls written as JSON, shared by the JSON-format parsers (hermes, llama3_json,
mistral, qwen3_coder's values): `parse_json` for model output, a call object's name and
arguments (`call_from_object`), and the head of one still being written (`call_head`), so
its arguments can stream before the object is complete."""

from __future__ import annotations

import json
from typing import Any


def parse_json(text: str) -> Any:
    """`json.loads` for model output. Python's decoder recurses once per level and raises
    RecursionError (not a ValueError) near 1,000 levels, which model output can reach, so
    that is a ValueError here like any other text that is not JSON."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply to read") from exc


def arguments_json(value: Any) -> str | None:
    """A call's arguments as a JSON object string, or None when they are not an object.

    Accepts a dict, or a string holding a JSON object (some models double-encode).
    """
    if isinstance(value, str):
        try:
            value = parse_json(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # the encoder recurses per level too
        return None


def call_from_object(obj: Any) -> tuple[str, str] | None:
    """{"name": ..., "arguments" | "parameters": {...}} -> (name, arguments JSON) or None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    else:
        args = {}
    text = arguments_json({} if args is None else args)
    return None if text is None else (name, text)


_JSON_WS = " \t\r\n"


def _json_string_end(text: str, i: int, n: int) -> int | None:
    """Index past the JSON string opening at text[i] ('"'), or None if it is unfinished."""
    j = i + 1
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def call_head(text: str, start: int, stop: int | None = None,
              keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, int] | bool | None:
    """Reads the head of a JSON call object, `{"name": "f", "arguments": {`, from its `{`
    at text[start] (up to `stop`). (name, index of the arguments' `{`) once it is all there;
    False when the object cannot begin that way (another key order, no arguments,
    arguments that are not an object): it can only be read whole; None while undecided."""
    n = len(text) if stop is None else stop
    i = start + 1
    expect = ("key:name", ":", "name", ",", "key:args", ":", "{")
    name = ""
    for what in expect:
        while i < n and text[i] in _JSON_WS:
            i += 1
        if i >= n:
            return None
        c = text[i]
        if what in (":", ",", "{"):
            if c != what:
                return False
            if what == "{":
                return name, i
            i += 1
            continue
        if c != '"':
            return False
        end = _json_string_end(text, i, n)
        if end is None:
            return None
        try:
            value = parse_json(text[i:end])
        except ValueError:
            return False
        if what == "key:name" and value != "name":
            return False
        if what == "key:args" and value not in keys:
            return False
        if what == "name":
            if not value:
                return False
            name = value
        i = end
    return False  # not reached
