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

    def _reset(self) -> None:
        self._mode = _START
        self._wrapped = False
        self._scanner: PythonValueEnd | None = None
        self._list_start = 0

    def _step(self, final: bool) -> bool:
        buf = self._buf
        mode = self._mode
        if mode == _START:
            rest = buf.lstrip()
            if not rest:
                if final:
                    self._mode = _CONTENT
                    return True
                return False
            if rest.startswith(_PY_START):
                self._buf = rest[len(_PY_START):]
                self._wrapped = True
                self._mode = _LIST
            elif _PY_START.startswith(rest) and not final:
                return False
            else:
                self._mode = _LIST if rest[0] == "[" else _CONTENT
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
                self._mode = _CONTENT
                return True
            self._list_start = start
            self._scanner = PythonValueEnd(start)
        end = self._scanner.scan(buf)
        if end is None:
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
