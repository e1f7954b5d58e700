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

from postproc.tool_parsers.base import ToolParser
from postproc.tool_parsers.call_json import call_from_object, call_head, parse_json
from postproc.tool_parsers.scanners import JsonValueEnd
from shared.grammar_parts import call_json_schema

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
        self._scanner: JsonValueEnd | None = None  # an object read whole
        self._args: JsonValueEnd | None = None  # a call's arguments, streaming
        self._outer: JsonValueEnd | None = None  # the rest of that call's object
        self._sent = 0

    def _step(self, final: bool) -> bool:
        mode = self._mode
        if mode == _START:
            opening = self._opening(_TAG, "{", final)
            if opening is None:
                return False
            self._mode = _CONTENT if opening == "content" else _CALLS
            return True
        if mode == _CONTENT:
            if self._content_until((_TAG,), final) is None:
                return False
            self._mode = _CALLS
            return True
        if mode == _SEP:
            return self._separator(self._buf, final)
        # _CALLS: a JSON object is expected (after whitespace).
        if self._args is not None:
            return self._streaming(self._buf, final)
        return self._call_object(self._buf, final)

    def _separator(self, buf: str, final: bool) -> bool:
        """After a call: `;` or another `{` goes on with calls, anything else is content."""
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

    def _call_object(self, buf: str, final: bool) -> bool:
        """A call's JSON object: streamed when its head is `{"name": ..., "parameters": {`,
        else read whole (`_whole_object`)."""
        if self._scanner is None:
            rest = buf.lstrip()
            if not rest:
                self._buf = "" if final else buf
                return False
            if rest[0] != "{":
                self._mode = _CONTENT
                return True
            start = len(buf) - len(rest)
            head = call_head(buf, start)
            if head is None and not final:
                return False  # `{"name": "f", "parameters": {` may still be arriving
            if head:  # the arguments stream as they are written
                name, value_start = head
                self._open_call(name)
                self._args, self._outer, self._sent = JsonValueEnd(value_start), None, value_start
                return True
            self._scanner = JsonValueEnd(start)  # any other object is read whole
        return self._whole_object(buf, final)

    def _whole_object(self, buf: str, final: bool) -> bool:
        """An object read whole: a call once it closes, else content."""
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
            call = call_from_object(parse_json(buf[:end]))
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

    def _streaming(self, buf: str, final: bool) -> bool:
        """Inside a call whose header went out: its arguments as written, then the rest of
        its object (markup). The output ending first leaves the call as far as it went."""
        if self._outer is None:
            end = self._args.scan(buf)
            upto = self._args.pos if end is None else end
            self._call_args(buf[self._sent:upto])
            self._sent = upto
            if end is None:
                return self._end_streaming("") if final else False
            self._outer = JsonValueEnd(end)
            self._outer.depth = 1  # inside the call object
        end = self._outer.scan(buf)
        if end is None:
            return self._end_streaming("") if final else False
        self._mode = _SEP
        return self._end_streaming(buf[end:]) or True

    def _end_streaming(self, rest: str) -> bool:
        self._close_call()
        self._args = self._outer = None
        self._buf = rest
        return False
