"""granite: IBM Granite 3.x calls, a JSON array at the start of the output.

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

The output is a call list when it begins (after whitespace) with `<|tool_call|>` (a special
token; `<tool_call>` as text is accepted too) or with `[`, followed by an array of call
objects (`"arguments"` or `"parameters"`, either key order). Each call goes out when its
object closes; text after the array is content. An element that is not a call makes the
rest content. (Granite 4 writes hermes' `<tool_call>{...}</tool_call>`: use `hermes`.)
"""

from __future__ import annotations

import json
from typing import Any

from postproc.tool_parsers.base import ToolParser
from postproc.tool_parsers.call_json import call_from_object, parse_json
from postproc.tool_parsers.scanners import JsonValueEnd
from shared.grammar_parts import call_json_schema, special_token_lark

_TOKEN = "<|tool_call|>"
_TEXT_TAG = "<tool_call>"
_START, _CONTENT, _OPEN, _ELEMENT, _AFTER = range(5)


class GraniteToolParser(ToolParser):
    name = "granite"
    delimiters = (_TOKEN,)
    begin_marker = _TOKEN + "["
    begin_lark = json.dumps(begin_marker)
    next_call_lark = '", "'
    end_lark = '"]"'
    calls_at_start = True

    @classmethod
    def for_vocabulary(cls, tokenizer: Any) -> type[ToolParser]:
        token = special_token_lark(tokenizer, _TOKEN)
        if token is None:
            return cls
        return type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                            "begin_lark": f'{token} "["'})

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        schema = json.dumps(call_json_schema(functions, "arguments", strict=strict))
        return f"call: %json {schema}\n"

    def _reset(self) -> None:
        self._mode = _START
        self._tag = ""
        self._given = ""  # the array's opening, given back if no call follows
        self._scanner: JsonValueEnd | None = None

    def _step(self, final: bool) -> bool:
        mode = self._mode
        if mode == _START:
            return self._opening_tag(final)
        if mode == _CONTENT:
            self._content_until((), final, hold=self.delimiters)
            return False
        rest = self._buf.lstrip()
        if not rest:
            if final:
                self._buf, self._mode = "", _CONTENT
            return False
        if mode == _OPEN:  # `[{` opens the array
            return self._array(rest, final)
        if mode == _AFTER:  # `,` goes on, `]` ends the calls
            if rest[0] == "]":
                self._buf, self._mode = rest[1:], _CONTENT
                return True
            return self._expect(rest, ",", _ELEMENT)
        return self._element(rest, final)

    def _opening_tag(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        for tag in (_TOKEN, _TEXT_TAG):
            if rest.startswith(tag):
                self._buf, self._mode = rest[len(tag):], _OPEN
                self._tag = tag
                return True
            if rest and tag.startswith(rest) and not final:
                return False
        if not rest and not final:
            return False
        self._mode = _OPEN if rest.startswith("[") else _CONTENT
        return True

    def _array(self, rest: str, final: bool) -> bool:
        """`[` then `{`: the calls begin; anything else is content, the tag given back if it
        was ordinary text."""
        body = rest[1:].lstrip() if rest[0] == "[" else None
        if body == "" and not final:
            return False
        if not body or body[0] != "{":
            self._buf = (self._tag if self._tag == _TEXT_TAG else "") + self._buf
            self._mode = _CONTENT
            return True
        given = self._buf[: len(self._buf) - len(body)]
        self._given = (self._tag if self._tag == _TEXT_TAG else "") + given
        self._buf, self._mode = body, _ELEMENT
        return True

    def _expect(self, rest: str, char: str, then: int) -> bool:
        if rest[0] != char:
            self._mode = _CONTENT
            return True
        self._buf, self._mode = rest[1:], then
        return True

    def _element(self, rest: str, final: bool) -> bool:
        """One call object, read whole when it closes."""
        if rest[0] != "{":
            self._mode = _CONTENT
            return True
        if self._scanner is None:
            self._buf, self._scanner = rest, JsonValueEnd(0)
        end = self._scanner.scan(self._buf)
        if end is None:
            if final:
                self._scanner = None
                if not self._drop_unfinished(final):
                    if not self._num_calls:
                        self._buf = self._given + self._buf
                    self._mode = _CONTENT
                    return True
            return False
        self._scanner = None
        try:
            call = call_from_object(parse_json(self._buf[:end]))
        except ValueError:
            call = None
        if call is None:  # not a call list after all: nothing of it is lost
            if not self._num_calls:
                self._buf = self._given + self._buf
            self._mode = _CONTENT
            return True
        self._call(*call)
        self._buf, self._mode = self._buf[end:], _AFTER
        return True
