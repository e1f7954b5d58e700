"""pythonic: a Python list of calls with keyword arguments (Llama 3.2 / Llama 4 style).

    [get_weather(city="San Francisco", days=3), get_time()]

The output is a call list when it begins (after whitespace) with `[name(`, or when
`<|python_start|>` opens one (Llama 4; `<|python_end|>` may close it). The list is parsed with
`ast`, never evaluated: argument values must be literals (strings, numbers, True/False/None
or true/false/null, lists, tuples, dicts). Anything else, positional arguments, or a list
that never closes makes the text content. Text after the list is content.
"""

from __future__ import annotations

import ast
import json
import keyword as _keyword
import re
from typing import Any

from postproc.tool_parsers.base import ToolParser
from postproc.tool_parsers.scanners import PythonValueEnd

_PY_START = "<|python_start|>"
_PY_END = "<|python_end|>"
_HEAD = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_HEAD_PARTIAL = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}

_START, _CONTENT, _LIST, _AFTER = range(4)


class PythonicToolParser(ToolParser):
    name = "pythonic"
    delimiters = (_PY_START, _PY_END)
    # Forced calls: `[` opens the list, calls are separated by ", " and `]` closes it.
    begin_marker = "["
    begin_lark = '"["'
    next_call_lark = '", "'
    end_lark = '"]"'
    calls_at_start = True

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        return _call_grammar(functions, strict=strict)

    def _reset(self) -> None:
        self._mode = _START
        self._wrapped = False
        self._scanner: PythonValueEnd | None = None
        self._list_start = 0

    def _step(self, final: bool) -> bool:
        buf = self._buf
        mode = self._mode
        if mode == _START:
            opening = self._opening(_PY_START, "[", final)
            if opening is None:
                return False
            self._wrapped = opening == "tag"
            self._mode = _CONTENT if opening == "content" else _LIST
            return True
        if mode == _CONTENT:
            tag = self._content_until(self.delimiters, final)
            if tag is None:
                return False
            if tag == _PY_START:
                self._wrapped = True
                self._mode = _LIST
            return True
        if mode == _AFTER:
            rest = buf.lstrip()
            if rest.startswith(_PY_END):
                self._buf = rest[len(_PY_END):]
            elif not final and _PY_END.startswith(rest):
                return False  # "" or a prefix of <|python_end|>
            self._mode = _CONTENT
            return True
        return self._list(buf, final)

    def _list(self, buf: str, final: bool) -> bool:
        if self._scanner is None:
            start = len(buf) - len(buf.lstrip())
            if start == len(buf):
                if final:
                    self._mode = _CONTENT
                    return True
                return False
            if not _HEAD.match(buf, start):
                if not final and _HEAD_PARTIAL.fullmatch(buf, start):
                    return False  # could still become `[name(`
                if _HEAD_PARTIAL.fullmatch(buf, start) and self._drop_unfinished(final):
                    return False  # `[get_wea` cut by max_tokens: not content
                self._mode = _CONTENT
                return True
            self._list_start = start
            self._scanner = PythonValueEnd(start)
        end = self._scanner.scan(buf)
        if end is None:
            if self._drop_unfinished(final):  # cut by max_tokens inside the list
                self._scanner = None
                self._mode = _CONTENT
                return False
            if final:
                self._scanner = None
                self._mode = _CONTENT
                return True
            return False
        self._scanner = None
        calls = parse_call_list(buf[self._list_start:end])
        if calls is None:
            self._mode = _CONTENT  # read the same text again as content
            return True
        for name, arguments in calls:
            self._call(name, arguments)
        self._buf = buf[end:]
        self._mode = _AFTER if self._wrapped else _CONTENT
        return True


def parse_call_list(text: str) -> list[tuple[str, str]] | None:
    """`[f(a=1), g()]` -> [(name, arguments JSON)], or None if it is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        arguments: dict[str, Any] = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = _literal(keyword.value)
            except ValueError:
                return None
        try:
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
        except (TypeError, ValueError):
            return None
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str | int | float | bool) or node.value is None:
            if isinstance(node.value, float) and node.value != node.value:
                raise ValueError("NaN")
            return node.value
        raise ValueError("unsupported constant")
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                raise ValueError("** in a dict")
            k = _literal(key)
            if not isinstance(k, str | int | float | bool) and k is not None:
                raise ValueError("unhashable key")
            out[k if isinstance(k, str) else json.dumps(k)] = _literal(value)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")


# ---------------------------------------------------------------- the grammar side (C-1..C-3)

# Python literal spellings of JSON values. Strings: single or double quotes, no raw control
# characters, the escapes \\ \" \' \n \r \t and \uXXXX outside the surrogates (a lone one
# cannot be sent on). Numbers: exponents of at most two digits and at most 100 integer digits,
# so no literal overflows to inf.
_STR_BODY = (r"""[^{q}\\\x00-\x1f\x7f]|\\[\\"'nrt]|"""
             r"\\u([0-9a-cA-CefEF][0-9a-fA-F]{{3}}|[dD][0-7][0-9a-fA-F]{{2}})")
_PY_TERMINALS = (
    "PY_STR: /\"(" + _STR_BODY.format(q='"') + ")*\"|'(" + _STR_BODY.format(q="'") + ")*'/\n"
    "PY_INT: /-?(0|[1-9][0-9]*)/\n"
    "PY_NUM: /-?(0|[1-9][0-9]{0,99})(\\.[0-9]+)?([eE][+-]?[0-9]{1,2})?/\n"
    "PY_KW: /[A-Za-z_][A-Za-z0-9_]*/ & ~/(" + "|".join(_keyword.kwlist + ["__debug__"]) + ")/\n"
    'py_any: PY_STR | PY_NUM | "True" | "False" | "None" | py_list | py_dict\n'
    'py_list: "[" (py_any (", " py_any)*)? "]"\n'
    'py_dict: "{" (PY_STR ": " py_any (", " PY_STR ": " py_any)*)? "}"\n'
)
# Keywords that only describe (no constraint) and those each type can honour.
_ANNOTATIONS = {"description", "title", "examples", "default", "$comment", "deprecated",
                "readOnly", "writeOnly", "$schema", "$id", "$defs", "definitions",
                "additionalProperties", "strict"}
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_HANDLED = {"type", "enum", "const", "anyOf", "oneOf", "$ref", "properties", "required",
            "items", "minItems", "maxItems", *_NUMERIC}
_BOOL_NAMES = {True: "True", False: "False", None: "None"}


def py_literal(value: Any) -> str:
    """A JSON value as a Python literal the parser reads back to the same value."""
    if isinstance(value, bool) or value is None:
        return _BOOL_NAMES[value]
    if isinstance(value, int | float | str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(py_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {py_literal(v)}"
                               for k, v in value.items()) + "}"
    raise ValueError(f"{value!r} is not a JSON value")


class _PyGrammar:
    """Lark rules for Python literals that follow JSON schemas (see `call_grammar`)."""

    def __init__(self, root: dict, *, strict: bool, prefix: str):
        self.root, self.strict, self.prefix = root, strict, prefix
        self.rules: list[str] = []
        self.refs: dict[str, str] = {}

    def rule(self, body: str) -> str:
        name = f"{self.prefix}_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def unsupported(self, what: str) -> None:
        if self.strict:
            raise ValueError(f"the pythonic format cannot enforce {what}")

    def value(self, schema: Any) -> str:
        """A Lark expression for one value that `schema` allows."""
        if schema is True or schema == {}:
            return "py_any"
        if not isinstance(schema, dict):
            raise ValueError("a schema that allows nothing cannot be called")
        for key in schema.keys() - _ANNOTATIONS - _HANDLED:
            self.unsupported(f"{key!r}")
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        if "const" in schema:
            return json.dumps(py_literal(schema["const"]), ensure_ascii=False)
        if "enum" in schema:
            if not schema["enum"]:
                raise ValueError("an empty enum allows nothing")
            return "(" + " | ".join(json.dumps(py_literal(v), ensure_ascii=False)
                                    for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                subs = [self.value({**rest, **sub} if isinstance(sub, dict) else sub)
                        for sub in schema[key]]
                return "(" + " | ".join(subs) + ")"
        kinds = schema.get("type")
        if kinds is None:
            kinds = ("object" if "properties" in schema else "array" if "items" in schema
                     else None)
        if kinds is None:
            return "py_any"
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        return "(" + " | ".join(self.typed(kind, schema) for kind in kinds) + ")"

    def typed(self, kind: str, schema: dict) -> str:
        if kind == "string":
            return "PY_STR"
        if kind in ("integer", "number"):
            bounds = {k: schema[k] for k in _NUMERIC if k in schema}
            if bounds:  # llguidance's JSON numbers are Python literals too
                return "%json " + json.dumps({"type": kind, **bounds})
            return "PY_INT" if kind == "integer" else "PY_NUM"
        if kind == "boolean":
            return '("True" | "False")'
        if kind == "null":
            return '"None"'
        if kind == "array":
            item = self.value(schema.get("items", True))
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            if low == 0 and high is None:
                return self.rule(f'"[" ({item} (", " {item})*)? "]"')
            more = f'(", " {item}){{{max(low - 1, 0)},{"" if high is None else high - 1}}}'
            body = f'"[" {item} {more} "]"'
            if high == 0:
                body = '"[" "]"'
            elif low == 0:
                body = f'"[" ({item} {more})? "]"'
            return self.rule(body)
        if kind == "object":
            properties = schema.get("properties")
            if not isinstance(properties, dict):
                properties = {}
            self.closed(schema, properties)
            if not properties:
                return "py_dict" if schema.get("additionalProperties") is not False \
                    else '("{" "}")'
            items = [(json.dumps(json.dumps(k, ensure_ascii=False), ensure_ascii=False)
                      + ' ": " ' + self.value(v), k in schema.get("required", ()))
                     for k, v in properties.items()]
            return self.rule('"{" ' + self.sequence(items) + ' "}"')
        raise ValueError(f"unknown JSON type {kind!r}")

    def ref(self, ref: Any) -> str:
        if ref not in self.refs:
            parts = ref.split("/") if isinstance(ref, str) else []
            target: Any = self.root
            if len(parts) != 3 or parts[0] != "#":
                raise ValueError(f"the pythonic format cannot follow $ref {ref!r}")
            for part in parts[1:]:
                target = target.get(part) if isinstance(target, dict) else None
            if target is None:
                raise ValueError(f"$ref {ref!r} points nowhere")
            name = f"{self.prefix}_ref{len(self.refs)}"
            self.refs[ref] = name  # before the body: recursive schemas refer to themselves
            self.rules.append(f"{name}: {self.value(target)}")
        return self.refs[ref]

    def closed(self, schema: dict, properties: dict) -> None:
        """Checks what an object's declared properties cannot express."""
        missing = [k for k in schema.get("required") or () if k not in properties]
        if missing:
            raise ValueError(f"the pythonic format cannot write the required {missing[0]!r}, "
                             "which has no schema")
        if isinstance(schema.get("additionalProperties"), dict):
            self.unsupported("a schema for additionalProperties")

    def sequence(self, items: list[tuple[str, bool]]) -> str:
        """`items` (expression, required) in order, comma-separated, the optional ones
        optional: rules `first_i` (nothing written yet) and `after_i` (something written)."""
        first, after = '""', '""'
        for expr, required in reversed(items):
            new_after = self.rule(f'", " {expr} {after}' + ("" if required else f" | {after}"))
            first = self.rule(f"{expr} {after}" + ("" if required else f" | {first}"))
            after = new_after
        return first

    def arguments(self, schema: dict) -> str:
        """Keyword arguments for a function whose arguments follow `schema`."""
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            properties = {}
        self.closed(schema, properties)
        if not properties and schema.get("additionalProperties") is not False:
            # Free keywords. (A repeated one is a Python syntax error: no grammar rules it out.)
            return '(PY_KW "=" py_any (", " PY_KW "=" py_any)*)?'
        required = schema.get("required") or ()
        items = []
        for name, sub in properties.items():
            spellable = name.isidentifier() and not _keyword.iskeyword(name) \
                and name != "__debug__"
            if not spellable:
                if name in required:
                    raise ValueError(f"the pythonic format cannot spell the keyword {name!r}")
                self.unsupported(f"the keyword {name!r}")
                continue
            items.append((f'"{name}=" {self.value(sub)}', name in required))
        return self.sequence(items) if items else '""'


def _call_grammar(functions: dict[str, Any], *, strict: bool) -> str:
    """`call` for pythonic: `name(keyword=literal, ...)` for one of `functions`."""
    rules, names = [], []
    for i, (name, schema) in enumerate(functions.items()):
        if not all(p.isidentifier() and not _keyword.iskeyword(p) for p in name.split(".")):
            raise ValueError(f"the pythonic format cannot spell the function name {name!r}")
        root = schema if isinstance(schema, dict) else {}
        for key in root.keys() - _ANNOTATIONS - {"type", "properties", "required"}:
            if strict:
                raise ValueError(f"the pythonic format cannot enforce {key!r} on arguments")
        g = _PyGrammar(root, strict=strict, prefix=f"py{i}")
        arguments = g.arguments(root)
        names.append(f"py{i}")
        rules.append(f'py{i}: {json.dumps(name + "(", ensure_ascii=False)} {arguments} ")"')
        rules += g.rules
    return "call: " + " | ".join(names) + "\n" + "\n".join(rules) + "\n" + _PY_TERMINALS
