"""openai_gptoss: gpt-oss's Harmony channels (vLLM's name). `analysis` messages (and messages
to a built-in tool) are reasoning; `final` messages and `commentary` preambles are content,
without their headers. A message to `functions.NAME` is a tool call: it is passed on to the
tool-call parser (`openai`) as one canonical Harmony message,
`<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>`, so without a tool-call
parser (a request without tools) it stays in the content as that text.

The Harmony markers are the parser's delimiters: they never reach reasoning or content."""

from __future__ import annotations

from postproc.harmony import (
    CALL,
    CHANNEL,
    FUNCTIONS,
    MARKERS,
    MESSAGE,
    REASONING,
    HarmonyReader,
    HarmonySink,
)
from postproc.reasoning.base import ReasoningParser


class _Split(HarmonySink):
    def __init__(self, parser: GptOssReasoningParser) -> None:
        self.parser = parser

    def text(self, route: str, text: str) -> None:
        (self.parser._reasoning if route == REASONING else self.parser._content).append(text)

    def open_call(self, name: str) -> None:
        self.parser._content.append(f"{CHANNEL}commentary to={FUNCTIONS}{name}{MESSAGE}")

    def call_args(self, fragment: str) -> None:
        self.parser._content.append(fragment)

    def close_call(self) -> None:
        self.parser._content.append(CALL)


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    # The analysis channel's opening and the final channel's, as the thinking budget and the
    # forced-call grammar spell a thinking section: the model's own header for it
    # (`<|channel|>analysis<|message|>`) up to the message's end.
    start_tag = f"{CHANNEL}analysis{MESSAGE}"
    end_tag = "<|end|>"
    delimiters = MARKERS
    thinks_by_default = False

    @classmethod
    def initial_thinking(cls, prompt_text: str, *, forced_call: bool = False) -> bool:
        # Every gpt-oss turn opens with a header the model writes: never inside a section.
        return False

    @classmethod
    def section_lark(cls, *, inside: bool) -> str:
        """One analysis message and the next message's header start, in special tokens
        (free text can never hold one, so the body ends at the model's `<|end|>`)."""
        return ('think: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> '
                '"assistant"\n')

    def _start(self, thinking: bool) -> None:
        super()._start(False)
        self._reader = HarmonyReader(_Split(self))

    @property
    def in_reasoning(self) -> bool:
        return self._reader.route == REASONING

    def _run(self, final: bool) -> None:
        buf, self._buf = self._buf, ""
        self._reader.feed(buf)
        if final:
            self._reader.finish()
