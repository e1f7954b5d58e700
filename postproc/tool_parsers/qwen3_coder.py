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

from postproc.tool_parsers.call_json import parse_json
from postproc.tool_parsers.tagged import TaggedBlockParser
from shared.grammar_parts import json_layout

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

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        return _call_grammar(functions, strict=strict)

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
        declared = self.tools.get(function)
        schema = declared.parameters if declared is not None else None
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
                number = parse_json(text)
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
        return parse_json(text)
    except ValueError:
        pass
    try:  # Python literal spelling: single quotes, True/False/None
        decoded = ast.literal_eval(text)
        json.dumps(decoded)
        return decoded
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


# ---------------------------------------------------------------- the grammar side (C-1..C-3)

_TAGS = ("<tool_call>", "</tool_call>", _FUNCTION, _FUNCTION_END, _PARAMETER, _PARAMETER_END)
_ANNOTATIONS = {"description", "title", "examples", "default", "$comment", "deprecated",
                "readOnly", "writeOnly", "$schema", "$id", "$defs", "definitions",
                "additionalProperties", "strict"}
_STRING_KEYWORDS = {"type", "enum", "const", "anyOf", "oneOf"}
_WS = r"[\s\x1c-\x1f]*"  # what str.strip() removes
# Texts a raw value must not be, when the parameter may also be of that type: the parser
# would convert them (a string "42" of a string-or-integer parameter reads back as 42).
_LOOKS_LIKE = {
    "integer": r"[+-]?[\d_]+",
    "number": r"-?\d+(\.\d+)?([eE][+-]?\d+)?|NaN|-?Infinity",
    "boolean": r"(?i:true|false)",
    "null": "null",
    "object": r"[\[{](?s:.*)",
    "array": r"[\[{](?s:.*)",
}


# The same, as written in a union with a string (JSON spellings).
_SCALARS = {
    "integer": r"-?(0|[1-9][0-9]*)",
    "number": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?",
    "boolean": "true|false",
    "null": "null",
}


def _regex_text(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in text)


def _lark_text(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class _CoderGrammar:
    # What ends a value and the tags a raw value cannot hold (glm45 reuses the typing).
    close = "\n" + _PARAMETER_END
    tags = _TAGS
    fmt = "qwen3_coder"

    def __init__(self, root: dict, *, strict: bool):
        self.strict = strict
        self.defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
        self.terminals: dict[str, str] = {}  # regex body -> terminal name

    def unsupported(self, what: str) -> None:
        if self.strict:
            raise ValueError(f"the {self.fmt} format cannot enforce {what}")

    def raw(self, exclude: tuple[str, ...] = (), scalars: tuple[str, ...] = ()) -> str:
        """A terminal: raw text that holds no tag, then `\\n</parameter>`; not one of the
        `exclude`d shapes (after stripping); or one of the `scalars` regexes."""
        close = _regex_text(self.close)
        tags = "|".join(_regex_text(t) for t in self.tags)
        body = f"/(?s:.*){close}/ & ~/(?s:.*)({tags})(?s:.*){close}/"
        if exclude:
            body += f" & ~/{_WS}({'|'.join(exclude)}){_WS}{close}/"
        if scalars:
            body = f"({body}) | /({'|'.join(scalars)}){close}/"
        if body not in self.terminals:
            self.terminals[body] = f"QC_RAW{len(self.terminals)}"
        return self.terminals[body]

    def json_value(self, schema: dict) -> str:
        layout = json_layout({**self.defs, **schema}, strict=self.strict)
        return f"%json {json.dumps(layout, ensure_ascii=False)}"

    def literals(self, values: list[Any], schema: Any) -> list[str]:
        """Literal alternatives (text and close tag) for the `values` that read back as
        themselves (strings as they are, other values as JSON)."""
        out = []
        for value in values:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            if any(t in text for t in self.tags):
                continue
            decoded = convert_value(text, schema)
            if decoded == value and type(decoded) is type(value):
                out.append(_lark_text(text + self.close))
        return out

    def value(self, schema: Any) -> str:
        """A Lark expression: one parameter's value, then `\\n</parameter>`."""
        close = _lark_text(self.close)
        types = schema_types(schema)
        if not isinstance(schema, dict) or not types:
            if isinstance(schema, dict):
                if isinstance(schema.get("const"), str):
                    return self.alternatives(self.literals([schema["const"]], schema))
                for key in schema.keys() - _ANNOTATIONS:
                    self.unsupported(f"{key!r} (without a type the value stays a string)")
            return self.raw()
        if "string" not in types:
            typed = schema if "type" in schema else {**schema, "type": types}
            return f"{self.json_value(typed)} {close}"
        if isinstance(schema.get("enum"), list) or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            return self.alternatives(self.literals(values, schema))
        others = [t for t in types if t != "string"]
        for key in schema.keys() - _ANNOTATIONS - _STRING_KEYWORDS:
            self.unsupported(f"{key!r} on a string" if not others else
                             f"{key!r} on a parameter that may be a string")
        if not others:
            return self.raw()
        # A string or something else: the raw text must not read as the something else. The
        # scalars are regexes inside the same terminal (a %json number beside a raw text
        # would leave the lexer two ways to read "42"); containers are JSON, which the raw
        # text cannot start like.
        alternatives = []
        containers = [t for t in others if t in ("object", "array")]
        if containers:
            alternatives.append(f"{self.json_value({**schema, 'type': containers})} {close}")
        scalars = tuple(_SCALARS[t] for t in others if t in _SCALARS)
        exclude = tuple(dict.fromkeys(_LOOKS_LIKE[t] for t in others if t in _LOOKS_LIKE))
        alternatives.append(self.raw(exclude, scalars))
        return self.alternatives(alternatives)

    @staticmethod
    def alternatives(options: list[str]) -> str:
        if not options:
            raise ValueError("no value can be written for this parameter")
        return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"

    def parameters(self, schema: dict) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            properties = {}
        required = schema.get("required") or ()
        missing = [k for k in required if k not in properties]
        if missing:
            raise ValueError(f"the {self.fmt} format cannot write the required "
                             f"{missing[0]!r}, which has no schema")
        if isinstance(schema.get("additionalProperties"), dict):
            self.unsupported("a schema for additionalProperties")
        if not properties and schema.get("additionalProperties") is not False:
            return self.any_parameters()
        parts = []
        for name, sub in properties.items():
            if not self.spells(name):
                if name in required:
                    raise ValueError(f"the {self.fmt} format cannot spell the parameter "
                                     f"{name!r}")
                self.unsupported(f"the parameter {name!r}")
                continue
            part = f'{self.parameter_head(name)} {self.value(sub)} "\\n"'
            parts.append(part if name in required else f"({part})?")
        return " ".join(parts) if parts else '""'

    # What a format's parameters look like (glm45 writes them otherwise).
    def any_parameters(self) -> str:
        """Parameters of any names, each a raw value: a schema without properties."""
        return f'("<parameter=" QC_NAME ">\\n" {self.raw()} "\\n")*'

    @staticmethod
    def spells(name: str) -> bool:
        return bool(name) and name == name.strip() and ">" not in name and "\n" not in name

    @staticmethod
    def parameter_head(name: str) -> str:
        return _lark_text(f"{_PARAMETER}{name}>" + chr(10))


def _call_grammar(functions: dict[str, Any], *, strict: bool) -> str:
    """`call` for qwen3_coder: the rest of one `<tool_call>` block for one of `functions`."""
    rules, names, terminals = [], [], {}
    for i, (name, schema) in enumerate(functions.items()):
        if not name or name != name.strip() or ">" in name or "\n" in name:
            raise ValueError(f"the qwen3_coder format cannot spell the function name {name!r}")
        root = schema if isinstance(schema, dict) else {}
        for key in root.keys() - _ANNOTATIONS - {"type", "properties", "required"}:
            if strict:
                raise ValueError(f"the qwen3_coder format cannot enforce {key!r} on arguments")
        g = _CoderGrammar(root, strict=strict)
        g.terminals = terminals  # shared: the same regex is one terminal
        head = _lark_text(f"\n{_FUNCTION}{name}>\n")
        rules.append(f"qc{i}: {head} {g.parameters(root)} "
                     f'"{_FUNCTION_END}\\n</tool_call>"')
        names.append(f"qc{i}")
    lines = [f"call: {' | '.join(names)}", *rules,
             "QC_NAME: /[A-Za-z_][A-Za-z0-9_.\\-]*/",
             *(f"{t}: {body}" for body, t in terminals.items())]
    return "\n".join(lines) + "\n"
