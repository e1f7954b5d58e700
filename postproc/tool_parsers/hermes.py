"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, anywhere.

Used by Hermes 2/3, Qwen2.5 and Qwen3 (non-coder) chat templates. A block whose JSON is
complete is accepted even when the output ends before `</tool_call>` (e.g. when the close tag
is a stop string).
"""

from __future__ import annotations

import json

from postproc.markers import find_first, partial_suffix_len
from postproc.tool_parsers.call_json import (
    call_from_object,
    call_head,
    parse_json,
)
from postproc.tool_parsers.scanners import JsonValueEnd
from postproc.tool_parsers.tagged import TaggedBlockParser
from shared.grammar_parts import call_json_schema


class HermesToolParser(TaggedBlockParser):
    name = "hermes"

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        schema = json.dumps(call_json_schema(functions, "arguments", strict=strict))
        return f'call: "\\n" call_json "\\n</tool_call>"\ncall_json: %json {schema}\n'

    def _reset(self) -> None:
        super()._reset()
        # Inside a block: None until the call's head is read; False when the block can only
        # be read whole (TaggedBlockParser's way); else the arguments' scanner.
        self._stream: JsonValueEnd | bool | None = None
        self._sent = 0  # how much of the block's text went out as arguments
        self._args_done = False

    def _step(self, final: bool) -> bool:
        if not self._in_block or self._stream is False:
            progressed = super()._step(final)
            if not self._in_block:
                self._stream = None
            return progressed
        tags = (self.open_tag, self.close_tag)
        buf = self._buf
        # The block ends at the first tag; text that may be the start of one is undecided.
        i, tag = find_first(buf, tags, self._search_from)
        if i >= 0:
            limit = i
        elif final:
            limit = len(buf)
        else:
            limit = len(buf) - partial_suffix_len(buf, tags)
            self._search_from = max(0, len(buf) - max(len(t) for t in tags) + 1)
        ended = i >= 0 or final
        if self._stream is None:
            start = len(buf[:limit]) - len(buf[:limit].lstrip())
            head = None if start >= limit else False if buf[start] != "{" else call_head(
                buf, start, limit)
            if head is None and not ended:
                return False  # the head is still arriving
            if not head:  # not `{"name": ..., "arguments": {`: the block is read whole
                self._stream = False
                return True
            name, value_start = head
            self._open_call(name)
            self._stream = JsonValueEnd(value_start)
            self._sent, self._args_done = value_start, False
        if not self._args_done:
            end = self._stream.scan(buf, limit)
            upto = self._stream.pos if end is None else end
            self._call_args(buf[self._sent:upto])
            self._sent = upto
            self._args_done = end is not None
        if not ended:
            return False  # the rest of the call object and the close tag are markup
        # The block is over (a tag, or the end of the output, unfinished arguments and all).
        rest = "" if i < 0 else buf[i + len(tag):] if tag == self.close_tag else buf[i:]
        self._close_call()
        self._buf, self._in_block, self._stream = rest, False, None
        return bool(rest) or not final

    def _block_calls(self, body: str, terminated: bool) -> list[tuple[str, str]] | None:
        try:
            obj = parse_json(body)
        except ValueError:
            return None
        call = call_from_object(obj)
        return [call] if call else None
