"""llama3_json: Llama 3.1 / 3.2 JSON tool calls.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output is a call when it begins (after whitespace) with `<|python_tag|>` or with `{`;
`<|python_tag|>` later in the text also starts calls. Objects may be separated by `;`
(the Llama convention), whitespace, or nothing. `"arguments"` is accepted for
`"parameters"`. An object that is not a call (no name, not JSON) is content, and so is
everything after it. `<|python_tag|>` is a special token: the request must keep special
tokens in the detokenized text (skip_special_tokens=False) for this parser to see it.
"""

from __future__ import annotations

import json

from postproc.tool_parsers.base import (
    ToolParser,
    call_from_object,
    call_json_schema,
)
from postproc.tool_parsers.scanners import JsonValueEnd

_TAG = "<|python_tag|>"

_START, _CONTENT, _CALLS, _SEP = range(4)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    delimiters = (_TAG,)
    begin_marker = _TAG
    begin_lark = _TAG  # a special token in Llama 3 vocabularies
    next_call_lark = '"; "'

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        schema = json.dumps(call_json_schema(functions, "parameters", strict=strict))
        return f"call: %json {schema}\n"

    def _reset(self) -> None:
        self._mode = _START
        self._scanner: JsonValueEnd | None = None

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
            if rest.startswith(_TAG):
                self._buf = rest[len(_TAG):]
                self._mode = _CALLS
            elif _TAG.startswith(rest) and not final:
                return False
            else:
                self._mode = _CALLS if rest[0] == "{" else _CONTENT
            return True
        if mode == _CONTENT:
            if self._content_until((_TAG,), final) is None:
                return False
            self._mode = _CALLS
            return True
        if mode == _SEP:
            rest = buf.lstrip()
            if not rest:
                self._buf = "" if final else buf
                return False
            if rest[0] == ";":
                self._buf = rest[1:]
                self._mode = _CALLS
            elif rest[0] == "{":
                self._mode = _CALLS
            else:
                self._mode = _CONTENT
            return True
        # _CALLS: a JSON object is expected (after whitespace).
        if self._scanner is None:
            rest = buf.lstrip()
            if not rest:
                self._buf = "" if final else buf
                return False
            if rest[0] != "{":
                self._mode = _CONTENT
                return True
            self._scanner = JsonValueEnd(len(buf) - len(rest))
        end = self._scanner.scan(buf)
        if end is None:
            if self._drop_unfinished(final):  # cut by max_tokens inside a call
                self._scanner = None
                return False
            if final:  # unfinished: content
                self._scanner = None
                self._mode = _CONTENT
                return True
            return False
        self._scanner = None
        try:
            call = call_from_object(json.loads(buf[:end]))
        except ValueError:
            call = None
        if call is None:
            self._text(buf[:end])
            self._mode = _CONTENT
        else:
            self._call(*call)
            self._mode = _SEP
        self._buf = buf[end:]
        return True
