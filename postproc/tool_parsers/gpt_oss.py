"""openai: tool calls in gpt-oss's Harmony format (vLLM's name).

A call is a message to `functions.NAME`, usually on the commentary channel:
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`. Its
header goes out as soon as the header is complete, and the arguments follow as the model
writes them (the body is the arguments, as text). `<|call|>` is a stop token, so a call
usually ends with the output; finish_reason is then "tool_calls".

Behind the `openai_gptoss` reasoning parser this sees content text and its canonical call
messages. Alone, it reads the model's raw Harmony output: then `analysis` text, which no
reasoning parser took, is content. See postproc.harmony for the routing rules."""

from __future__ import annotations

import json

from postproc.harmony import (
    CHANNEL,
    CONSTRAIN,
    END,
    FUNCTIONS,
    MARKERS,
    MESSAGE,
    START,
    HarmonyReader,
)
from postproc.harmony import HarmonySink as _Sink
from postproc.tool_parsers.base import ToolParser
from shared.grammar_parts import json_layout


class _Calls(_Sink):
    def __init__(self, parser: OpenAIToolParser) -> None:
        self.parser = parser

    def text(self, route: str, text: str) -> None:
        self.parser._text(text)

    def open_call(self, name: str) -> None:
        self.parser._open_call(name)

    def call_args(self, fragment: str) -> None:
        self.parser._call_args(fragment)

    def close_call(self) -> None:
        self.parser._close_call()


class OpenAIToolParser(ToolParser):
    name = "openai"
    delimiters = MARKERS
    # A forced call: the recipient's namespace opens it, the grammar writes the rest.
    begin_marker = f"{CHANNEL}commentary to={FUNCTIONS}"
    begin_lark = f'{CHANNEL} "commentary to={FUNCTIONS}"'
    next_call_lark = ""  # `<|call|>` ends the turn: one call per turn

    @classmethod
    def strict_start_lark(cls) -> str | None:
        """Messages on any channel, free, each ended by `<|end|>` and followed by the next
        header; the last is free or a call of one of the tools (the only recipients)."""
        return (f"start: (free {END} {START} \"assistant\")* (free | {cls.begin_lark} call)\n"
                f"free: {CHANNEL} CHAN {MESSAGE} TEXT\n"
                "CHAN: /analysis|final|commentary/\n"
                "TEXT: /(?s:.*)/\n")

    @classmethod
    def call_grammar(cls, functions: dict, *, strict: bool) -> str | None:
        """`NAME <|constrain|>json<|message|>ARGS` for one of `functions`. The `<|call|>`
        after it is a stop token: the engine's end of the grammar lets it come."""
        options = " | ".join(f"call_{i}" for i in range(len(functions)))
        rules = [f"call: {options}\n"]
        for i, (name, schema) in enumerate(functions.items()):
            layout = json.dumps(json_layout(schema, strict=strict))
            rules.append(f'call_{i}: {json.dumps(name)} " " {CONSTRAIN} "json" {MESSAGE} '
                         f"args_{i}\nargs_{i}: %json {layout}\n")
        return "".join(rules)

    def _reset(self) -> None:
        self._reader = HarmonyReader(_Calls(self))

    def _step(self, final: bool) -> bool:
        buf, self._buf = self._buf, ""
        if buf:
            self._reader.feed(buf)
        if final:
            self._reader.finish()
        return False
