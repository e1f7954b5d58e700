"""glm45: GLM-4.5 / 4.6's XML-ish calls, in hermes' `<tool_call>` blocks.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The function name opens the block; each argument is a key and a raw value (the chat template
writes strings as they are and other values as JSON; the newlines between the tags are
layout, and GLM-4.7's spelling without them reads the same). A value the tool's schema types
is converted as `qwen3_coder` converts it; a value without a schema is decoded as JSON (or a
Python literal) when it is one, else kept as a string, as vLLM's parser does. A block is a
call once `</tool_call>` closes it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from postproc.tool_parsers.qwen3_coder import (
    _ANNOTATIONS,
    _CoderGrammar,
    _container,
    _lark_text,
    convert_value,
)
from postproc.tool_parsers.tagged import TaggedBlockParser

_KEY, _KEY_END = "<arg_key>", "</arg_key>"
_VALUE, _VALUE_END = "<arg_value>", "</arg_value>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_TAGS = ("<tool_call>", "</tool_call>", _KEY, _KEY_END, _VALUE, _VALUE_END)


class Glm45ToolParser(TaggedBlockParser):
    name = "glm45"
    # GLM's vocabulary has the argument tags as special tokens too: as delimiters the
    # postproc step keeps them in the text this parser reads (processor.special_ids_to_skip).
    delimiters = _TAGS

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        return _call_grammar(functions, strict=strict)

    def _block_calls(self, body: str, terminated: bool) -> list[tuple[str, str]] | None:
        if not terminated:
            return None  # the output stopped inside the call
        first = body.find(_KEY)
        name = (body if first < 0 else body[:first]).strip()
        if not name or any(c.isspace() or c == "<" for c in name):
            return None
        arguments: dict[str, Any] = {}
        pos = 0 if first < 0 else first
        for m in _PAIR.finditer(body, pos):
            if m.start() != pos:
                return None
            arguments[m.group(1).strip()] = self._value(name, m.group(1).strip(), m.group(2))
            pos = m.end()
        if first >= 0 and body[pos:].strip():
            return None
        return [(name, json.dumps(arguments, ensure_ascii=False))]

    def _value(self, function: str, key: str, text: str) -> Any:
        declared = self.tools.get(function)
        schema = declared.parameters if declared is not None else None
        properties = schema.get("properties") if isinstance(schema, dict) else None
        sub = properties.get(key) if isinstance(properties, dict) else None
        if sub is not None:
            return convert_value(text, sub)
        decoded = _container(text.strip())
        return text if decoded is None and text.strip() != "null" else decoded


class _GlmGrammar(_CoderGrammar):
    close = _VALUE_END
    tags = _TAGS
    fmt = "glm45"

    def any_parameters(self) -> str:
        return f'("<arg_key>" GLM_KEY "</arg_key>\\n<arg_value>" {self.raw()} "\\n")*'

    @staticmethod
    def spells(name: str) -> bool:
        return bool(name) and name == name.strip() and not any(t in name for t in _TAGS)

    @staticmethod
    def parameter_head(name: str) -> str:
        return _lark_text(f"{_KEY}{name}{_KEY_END}\n{_VALUE}")


def _call_grammar(functions: dict[str, Any], *, strict: bool) -> str:
    """`call` for glm45: the rest of one `<tool_call>` block for one of `functions`."""
    rules, names, terminals = [], [], {}
    for i, (name, schema) in enumerate(functions.items()):
        if not name or any(c.isspace() or c == "<" for c in name):
            raise ValueError(f"the glm45 format cannot spell the function name {name!r}")
        root = schema if isinstance(schema, dict) else {}
        for key in root.keys() - _ANNOTATIONS - {"type", "properties", "required"}:
            if strict:
                raise ValueError(f"the glm45 format cannot enforce {key!r} on arguments")
        g = _GlmGrammar(root, strict=strict)
        g.terminals = terminals
        rules.append(f'glm{i}: {_lark_text(name + chr(10))} {g.parameters(root)} "</tool_call>"')
        names.append(f"glm{i}")
    lines = [f"call: {' | '.join(names)}", *rules, "GLM_KEY: /[A-Za-z_][A-Za-z0-9_.\\-]*/",
             *(f"{t}: {body}" for body, t in terminals.items())]
    return "\n".join(lines) + "\n"
