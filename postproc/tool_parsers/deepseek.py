"""deepseek_v3 and deepseek_v31: DeepSeek's tool-call markers (special tokens, with the
full-width bar `｜` and `▁`).

    deepseek_v3 (V3, R1, R1-0528):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    deepseek_v31 (V3.1, V3.2-Exp):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>      (one line: no newline in between)

Content may come before the section. See `marked.py` for the machine.
"""

from __future__ import annotations

import json

from postproc.tool_parsers.marked import MarkedCallParser

_CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
_CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
_SEP = "<\uff5ctool\u2581sep\uff5c>"
_FENCE = "```json"


def _plain_name(text: str) -> str | None:
    name = text.strip()
    return name if name and not any(c.isspace() for c in name) else None


class DeepSeekV3ToolParser(MarkedCallParser):
    name = "deepseek_v3"
    section_begins = (_CALLS_BEGIN,)
    section_ends = (_CALLS_END,)
    call_begin = _CALL_BEGIN
    head_end = _FENCE  # the head is `function<｜tool▁sep｜>NAME\n`; the fence opens the JSON
    call_end = _CALL_END
    call_gap = "\n"
    delimiters = (_CALLS_BEGIN, _CALLS_END, _CALL_BEGIN, _CALL_END, _SEP)

    @classmethod
    def _head_lark(cls, name: str) -> str:
        return f'"function" {cls.lark(_SEP)} {json.dumps(name + chr(10) + _FENCE + chr(10))}'

    @classmethod
    def _args_end_lark(cls) -> str:
        return f'"\\n```" {cls.lark(_CALL_END)}'

    def _head(self, text: str) -> tuple[str, str | None] | None:
        kind, sep, name = text.partition(_SEP)
        if not sep or kind.strip() != "function":
            return None
        name = _plain_name(name)
        return None if name is None else (name, None)

    def _args_text(self, body: str) -> str:
        return body.removesuffix("```")


class DeepSeekV31ToolParser(MarkedCallParser):
    name = "deepseek_v31"
    section_begins = (_CALLS_BEGIN,)
    section_ends = (_CALLS_END,)
    call_begin = _CALL_BEGIN
    head_end = _SEP
    call_end = _CALL_END
    delimiters = (_CALLS_BEGIN, _CALLS_END, _CALL_BEGIN, _CALL_END, _SEP)

    @classmethod
    def _head_lark(cls, name: str) -> str:
        return f"{json.dumps(name)} {cls.lark(_SEP)}"

    def _head(self, text: str) -> tuple[str, str | None] | None:
        name = _plain_name(text)
        return None if name is None else (name, None)
