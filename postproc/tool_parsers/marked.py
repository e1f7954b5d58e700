"""Formats whose calls sit between special-token markers in a section (DeepSeek V3 / V3.1,
Kimi K2): a section opens, each call is `call_begin HEAD head_end ARGS call_end`, the section
closes. Subclasses say what the markers are and how a head reads (`_head`).

    <section_begin><call_begin>HEAD<head_end>{"city": "Paris"}<call_end>...<section_end>

The call's header goes out when its head is read and the arguments' `{` has arrived; the
arguments then stream as the model writes them (`JsonValueEnd`), never a character that may
still be the start of a marker; a marker inside a JSON string is text of the arguments (a
forced call's grammar lets strings hold the markers' text), one outside ends the call.
Arguments that do not begin with `{` are read whole at the call's end: a JSON object is the
call, anything else is content (delimiters taken out).
The markers are special tokens: the request must keep special tokens in the detokenized text
(skip_special_tokens=False). Forced calls are written in the format's own spelling, the
markers named by token id when they are special tokens of the model (`for_vocabulary`).
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from postproc.markers import find_first, partial_suffix_len
from postproc.tool_parsers.base import ToolParser
from postproc.tool_parsers.call_json import arguments_json, parse_json
from postproc.tool_parsers.scanners import JsonValueEnd
from shared.grammar_parts import json_layout, special_token_lark

GRAMMAR_NAME = re.compile(r"[\w.\-]+")  # names a forced call writes and the head reads back

_TEXT, _SECTION, _HEAD, _ARGS, _STREAM, _TAIL, _WHOLE = range(7)


class MarkedCallParser(ToolParser):
    section_begins: ClassVar[tuple[str, ...]] = ()  # the first is what forced calls write
    section_ends: ClassVar[tuple[str, ...]] = ()  # the first is what forced calls write
    call_begin: ClassVar[str] = ""
    head_end: ClassVar[str] = ""
    call_end: ClassVar[str] = ""
    # What a forced call writes between calls, before the next `call_begin`.
    call_gap: ClassVar[str] = ""
    # Marker text -> its Lark spelling, for markers that are special tokens of the model.
    marker_lark: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.call_begin:
            return
        cls.begin_marker = cls.section_begins[0] + cls.call_begin
        if cls.marker_lark:
            cls.begin_lark = f"{cls.lark(cls.section_begins[0])} {cls.lark(cls.call_begin)}"
        else:  # one literal: the strict grammar then sees a text marker
            cls.begin_lark = json.dumps(cls.begin_marker)
        gap = f"{json.dumps(cls.call_gap)} " if cls.call_gap else ""
        cls.next_call_lark = gap + cls.lark(cls.call_begin)
        cls.end_lark = cls.lark(cls.section_ends[0])

    @classmethod
    def lark(cls, marker: str) -> str:
        return cls.marker_lark.get(marker) or json.dumps(marker)

    @classmethod
    def for_vocabulary(cls, tokenizer: Any) -> type[ToolParser]:
        markers = (cls.section_begins[0], cls.section_ends[0], cls.call_begin, cls.head_end,
                   cls.call_end)
        spelled = {m: s for m in markers if (s := special_token_lark(tokenizer, m))}
        if not spelled:
            return cls
        return type(cls.__name__, (cls,), {"__module__": cls.__module__, "marker_lark": spelled})

    @classmethod
    def strict_start_lark(cls) -> str | None:
        """With the markers as special tokens (free text cannot hold them), a section of
        calls may close with its end marker before more text. Text markers: the generic
        rules, where free text cannot spell the begin marker."""
        if not cls.marker_lark:
            return None
        calls = f"{cls.begin_lark} call ({cls.next_call_lark} call)* {cls.end_lark}?"
        return f"start: (TEXT {calls})* TEXT\nTEXT: /(?s:.*)/\n"

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        rules = []
        for i, (name, schema) in enumerate(functions.items()):
            if not GRAMMAR_NAME.fullmatch(name):
                raise ValueError(f"the {cls.name} format cannot spell the function name {name!r}")
            arguments = json.dumps(json_layout(schema, strict=strict), ensure_ascii=False)
            rules.append(f"{cls.name}_{i}: {cls._head_lark(name)} %json {arguments} "
                         f"{cls._args_end_lark()}")
        alternatives = " | ".join(f"{cls.name}_{i}" for i in range(len(rules)))
        return f"call: {alternatives}\n" + "\n".join(rules) + "\n" + cls._extra_lark()

    @classmethod
    def _head_lark(cls, name: str) -> str:
        """Lark for what a call of `name` writes from `call_begin` to the arguments."""
        raise NotImplementedError

    @classmethod
    def _args_end_lark(cls) -> str:
        return cls.lark(cls.call_end)

    @classmethod
    def _extra_lark(cls) -> str:
        return ""

    def _head(self, text: str) -> tuple[str, str | None] | None:
        """(function name, call id or None) from the text between `call_begin` and
        `head_end`; None when it is no head."""
        raise NotImplementedError

    def _args_text(self, body: str) -> str:
        """A whole arguments text without its layout (DeepSeek V3's code fence)."""
        return body

    def _args_prefix(self, rest: str, final: bool) -> int | None:
        """How much of `rest` (after `head_end` and whitespace) is layout before the
        arguments' `{`; None while undecided."""
        return 0

    # -- the machine -----------------------------------------------------------------------

    def _reset(self) -> None:
        self._mode = _TEXT
        self._head_info: tuple[str, str | None] | None = None
        self._head_text = ""
        self._scanner: JsonValueEnd | None = None
        self._sent = 0

    def _markers(self) -> tuple[str, ...]:
        return (*self.section_begins, *self.section_ends, self.call_begin, self.call_end)

    def _step(self, final: bool) -> bool:
        mode = self._mode
        if mode == _TEXT:
            tag = self._content_until((*self.section_begins, self.call_begin), final,
                                      hold=self.delimiters)
            if tag is None:
                return False
            self._mode = _HEAD if tag == self.call_begin else _SECTION
            return True
        if mode == _SECTION:  # between calls: whitespace, or text that is content
            tag = self._content_until((self.call_begin, *self.section_ends), final,
                                      hold=self.delimiters)
            if tag is None:
                return False
            self._mode = _HEAD if tag == self.call_begin else _TEXT
            return True
        if mode == _HEAD:
            return self._read_head(final)
        if mode == _ARGS:
            return self._args_begin(final)
        if mode == _STREAM:
            return self._stream_args(final)
        if mode == _TAIL:
            return self._tail(final)
        return self._whole(final)

    def _read_head(self, final: bool) -> bool:
        buf = self._buf
        i, tag = find_first(buf, (self.head_end, *self._markers()))
        if i < 0:
            if not final:
                return False
            if not self._drop_unfinished(final):
                self._text(buf)
            self._buf, self._mode = "", _TEXT
            return False
        head = self._head(buf[:i]) if tag == self.head_end else None
        if head is None:  # no call: its text is content, the section goes on
            self._text(buf[:i] if tag != self.head_end else buf[:i + len(tag)])
            self._buf = buf[i:] if tag != self.head_end else buf[i + len(tag):]
            self._mode = _SECTION
            return True
        self._head_text = buf[:i + len(tag)]  # given back as content if no call follows
        self._head_info, self._buf, self._mode = head, buf[i + len(tag):], _ARGS
        return True

    def _args_begin(self, final: bool) -> bool:
        buf = self._buf
        start = len(buf) - len(buf.lstrip())
        skip = self._args_prefix(buf[start:], final)
        if skip is None:
            if final:
                self._mode = _WHOLE
                return True
            return False
        pos = start + skip
        pos += len(buf[pos:]) - len(buf[pos:].lstrip())
        if pos >= len(buf) and not final:
            return False
        if pos < len(buf) and buf[pos] == "{":
            name, call_id = self._head_info
            self._open_call(name, call_id)
            self._buf, self._scanner, self._sent = buf[pos:], JsonValueEnd(0), 0
            self._mode = _STREAM
            return True
        self._mode = _WHOLE
        return True

    def _limit(self, buf: str, final: bool, start: int = 0) -> tuple[int, int, str | None]:
        """(where decided text ends, index of the next marker from `start` or -1, that
        marker)."""
        i, tag = find_first(buf, self._markers(), start)
        if i >= 0:
            return i, i, tag
        return (len(buf) if final else len(buf) - partial_suffix_len(buf, self._markers()),
                -1, None)

    def _stream_args(self, final: bool) -> bool:
        buf = self._buf
        search = self._scanner.pos
        while True:
            limit, i, tag = self._limit(buf, final, search)
            end = self._scanner.scan(buf, limit)
            if end is not None or i < 0 or not self._scanner.in_string:
                break
            search = i + 1  # a marker inside a JSON string is text of the arguments
        upto = self._scanner.pos if end is None else end
        self._call_args(buf[self._sent:upto])
        self._sent = upto
        if end is not None:
            self._buf, self._mode = buf[end:], _TAIL
            return True
        if i >= 0 or final:  # the call ended (a marker, the output) inside its arguments
            self._close_call()
            self._buf = buf[i:] if i >= 0 else ""
            self._mode = _SECTION
            return i >= 0
        return False

    def _tail(self, final: bool) -> bool:
        """After a streamed call's arguments: markup (a closing fence) up to `call_end`."""
        buf = self._buf
        _, i, tag = self._limit(buf, final)
        if i < 0 and not final:
            return False
        self._close_call()
        self._after_call = True
        self._buf = "" if i < 0 else buf[i + len(tag):] if tag == self.call_end else buf[i:]
        self._mode = _SECTION
        return i >= 0

    def _whole(self, final: bool) -> bool:
        """Arguments that did not open with `{`: read whole at the call's end."""
        buf = self._buf
        _, i, tag = self._limit(buf, final)
        if i < 0 and not final:
            return False
        body = buf if i < 0 else buf[:i]
        self._buf = "" if i < 0 else buf[i + len(tag):] if tag == self.call_end else buf[i:]
        self._mode = _SECTION
        arguments = _object_json(self._args_text(body.strip()))
        if arguments is not None:
            name, call_id = self._head_info
            self._call(name, arguments, call_id)
        elif not (i < 0 and self._drop_unfinished(final)):
            self._text(self._head_text + body)
        return bool(self._buf) or not final


def _object_json(text: str) -> str | None:
    try:
        value = parse_json(text)
    except ValueError:
        return None
    return arguments_json(value) if isinstance(value, dict) else None
