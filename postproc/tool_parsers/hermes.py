"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, anywhere.

Used by Hermes 2/3, Qwen2.5 and Qwen3 (non-coder) chat templates. A block whose JSON is
complete is accepted even when the output ends before `</tool_call>` (e.g. when the close tag
is a stop string).
"""

from __future__ import annotations

import json

from postproc.tool_parsers.base import call_from_object, call_json_schema
from postproc.tool_parsers.tagged import TaggedBlockParser


class HermesToolParser(TaggedBlockParser):
    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    delimiters = (open_tag, close_tag)
    begin_marker = open_tag
    begin_lark = '"<tool_call>"'
    next_call_lark = '"\\n<tool_call>"'

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        schema = json.dumps(call_json_schema(functions, "arguments", strict=strict))
        return f'call: "\\n" call_json "\\n</tool_call>"\ncall_json: %json {schema}\n'

    def _block_calls(self, body: str, terminated: bool) -> list[tuple[str, str]] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        call = call_from_object(obj)
        return [call] if call else None
