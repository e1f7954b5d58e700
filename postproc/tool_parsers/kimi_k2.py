"""kimi_k2: Kimi K2's tool-call markers (special tokens).

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
    (one line: no newlines in between)

The head is the call's id, `functions.NAME:INDEX`; the function name is NAME, and the id is
used as the call id as written, since Kimi's chat template writes it back in the next turn
(and `functions.NAME` alone is accepted, with a generated id). The singular
`<|tool_call_section_begin|>` / `<|tool_call_section_end|>` spellings some checkpoints write
are accepted too. See `marked.py` for the machine.
"""

from __future__ import annotations

import json
import re

from postproc.tool_parsers.marked import MarkedCallParser

_SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
_SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
_CALL_BEGIN = "<|tool_call_begin|>"
_ARG_BEGIN = "<|tool_call_argument_begin|>"
_CALL_END = "<|tool_call_end|>"
_HEAD = re.compile(r"(?:functions\.)?([^\s:]+)(:\d+)?")


class KimiK2ToolParser(MarkedCallParser):
    name = "kimi_k2"
    section_begins = _SECTION_BEGINS
    section_ends = _SECTION_ENDS
    call_begin = _CALL_BEGIN
    head_end = _ARG_BEGIN
    call_end = _CALL_END
    delimiters = (*_SECTION_BEGINS, *_SECTION_ENDS, _CALL_BEGIN, _ARG_BEGIN, _CALL_END)

    @classmethod
    def _head_lark(cls, name: str) -> str:
        return f"{json.dumps('functions.' + name + ':')} KIMI_INDEX {cls.lark(_ARG_BEGIN)}"

    @classmethod
    def _extra_lark(cls) -> str:
        return "KIMI_INDEX: /[0-9]{1,6}/\n"

    def _head(self, text: str) -> tuple[str, str | None] | None:
        head = text.strip()
        m = _HEAD.fullmatch(head)
        if m is None:
            return None
        return m.group(1), head if m.group(2) else None
