"""qwen3_coder: Qwen3-Coder's XML-ish calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (one newline after the open tag and one before the close tag
are layout, not value). They are typed with the tool's JSON schema from the request when it
has one for that parameter: integer, number, boolean, null, object and array values are
decoded; anything else, or a value that does not fit its declared type, stays a string.
Without a schema every value is a string.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from postproc.tool_parsers.tagged import TaggedBlockParser

_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"

_TYPE_ALIASES = {
    "int": "integer", "float": "number", "double": "number", "bool": "boolean",
    "dict": "object", "list": "array", "str": "string", "text": "string",
}


class Qwen3CoderToolParser(TaggedBlockParser):
    name = "qwen3_coder"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    delimiters = (open_tag, close_tag)

    def _block_calls(self, body: str, terminated: bool) -> list[tuple[str, str]] | None:
        if not terminated and _FUNCTION_END not in body:
            return None  # the output stopped inside the call
        calls = []
        parts = body.split(_FUNCTION)
        if parts[0].strip():
            return None  # text before the function: not this format
        for part in parts[1:]:
            end = part.find(">")
            name = part[:end].strip() if end >= 0 else ""
            if not name or "\n" in name:
                return None
            inner = part[end + 1:]
            close = inner.find(_FUNCTION_END)
            if close >= 0:
                if inner[close + len(_FUNCTION_END):].strip():
                    return None
                inner = inner[:close]
            arguments = self._arguments(name, inner)
            if arguments is None:
                return None
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        return calls or None

    def _arguments(self, function: str, inner: str) -> dict[str, Any] | None:
        properties = {}
        schema = self.tools.get(function, {}).get("parameters")
        if isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
            properties = schema["properties"]
        out: dict[str, Any] = {}
        pieces = inner.split(_PARAMETER)
        if pieces[0].strip():
            return None
        for piece in pieces[1:]:
            end = piece.find(">")
            if end < 0:
                return None
            pname = piece[:end].strip()
            if not pname or "\n" in pname:
                return None
            value = piece[end + 1:]
            close = value.find(_PARAMETER_END)
            if close >= 0:
                if value[close + len(_PARAMETER_END):].strip():
                    return None
                value = value[:close]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            out[pname] = convert_value(value, properties.get(pname))
        return out


def schema_types(schema: Any) -> list[str]:
    """The JSON types a schema allows, in a stable order ([] when it does not say)."""
    if not isinstance(schema, dict):
        return []
    found: list[str] = []
    kind = schema.get("type")
    if isinstance(kind, str):
        found.append(kind)
    elif isinstance(kind, list):
        found.extend(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            found.extend(schema_types(sub))
    if not found and isinstance(schema.get("enum"), list):
        for value in schema["enum"]:
            found.append(_json_type(value))
    if not found and isinstance(schema.get("properties"), dict):
        found.append("object")
    out: list[str] = []
    for t in found:
        t = _TYPE_ALIASES.get(t.lower(), t.lower())
        if t not in out:
            out.append(t)
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's raw text -> its JSON value, as the schema declares (string if unsure)."""
    types = schema_types(schema)
    if not types:
        return value
    text = value.strip()
    if text == "null" and ("null" in types or "string" not in types):
        return None
    for kind in types:
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                pass
        elif kind == "number":
            try:
                number = json.loads(text)
            except ValueError:
                number = None
            if isinstance(number, int | float) and not isinstance(number, bool):
                return number
        elif kind == "boolean":
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
        elif kind in ("object", "array"):
            decoded = _container(text)
            if isinstance(decoded, dict if kind == "object" else list):
                return decoded
    return value


def _container(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:  # Python literal spelling: single quotes, True/False/None
        decoded = ast.literal_eval(text)
        json.dumps(decoded)
        return decoded
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
