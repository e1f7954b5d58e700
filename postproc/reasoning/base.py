"""What the reasoning parsers share: a `<think>` / `</think>` state machine on streamed text.

One instance per request. The initial state comes from the rendered prompt (req O-5): a
template may have opened the thinking block already (`...<think>\n`: the output starts inside
it) or written a closed one (`<think>\n\n</think>\n\n`: thinking is off, the output is all
content). When the prompt says neither, the parser's own default applies.

Tags are never emitted, whole or in part: a possible prefix of one at the end of the text is
held back until the next piece decides it. A tag that changes nothing (`<think>` while
thinking, `</think>` while not) is dropped. Reasoning is trimmed of surrounding whitespace and
content that follows a `</think>` of leading whitespace (the model's layout around the tags);
content that is not preceded by a `</think>` in the output comes back exactly.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from postproc.markers import find_first, partial_suffix_len
from shared.grammar_parts import regex_literal

# Text after the prompt's last think tag that contains a turn marker means the tag belongs to
# an earlier turn (or a user message), not to the generation being started.
_TURN_MARKERS = ("<|", "<\uff5c", "<start_of_turn>", "<end_of_turn>", "[INST]", "[/INST]")

OPEN, CLOSED = "open", "closed"


class ReasoningDelta(msgspec.Struct):
    reasoning: str = ""
    content: str = ""


def prompt_think_state(prompt_text: str, start_tag: str, end_tag: str) -> str | None:
    """OPEN if the prompt leaves the model inside a thinking block, CLOSED if it ends right
    after a closed one, None if it says nothing about the turn being generated."""
    i, j = prompt_text.rfind(start_tag), prompt_text.rfind(end_tag)
    if i < 0 and j < 0:
        return None
    if i > j:
        state, tail = OPEN, prompt_text[i + len(start_tag):]
    else:
        state, tail = CLOSED, prompt_text[j + len(end_tag):]
    if any(marker in tail for marker in _TURN_MARKERS):
        return None
    return state


class ReasoningParser:
    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # More strings that never reach reasoning or content (gpt-oss's Harmony markers).
    delimiters: ClassVar[tuple[str, ...]] = ()
    # Whether the output starts inside the thinking block when the prompt does not say.
    thinks_by_default: ClassVar[bool] = False
    # Other spellings of the tags the model may write (Granite's "Here's ..."), and markers
    # that end thinking without a tag and stay in the content (Kimi K2's tool-call section).
    start_alternatives: ClassVar[tuple[str, ...]] = ()
    end_alternatives: ClassVar[tuple[str, ...]] = ()
    content_starts: ClassVar[tuple[str, ...]] = ()

    def __init__(self, prompt_text: str = "") -> None:
        self._start(self.initial_thinking(prompt_text))

    @classmethod
    def initial_thinking(cls, prompt_text: str, *, forced_call: bool = False) -> bool:
        """Whether output after this rendered prompt starts inside a thinking block.
        `forced_call`: a grammar forces a tool call (tool_choice "required"), and it lets
        thinking open only with `start_tag` (`section_lark`), so only the prompt can have
        opened it: the parser's default does not apply."""
        state = prompt_think_state(prompt_text, cls.start_tag, cls.end_tag)
        if state is None:
            return False if forced_call else cls.thinks_by_default
        return state == OPEN

    @classmethod
    def section_lark(cls, *, inside: bool) -> str:
        """Lark rules defining `think`: one thinking section as this parser reads it, for the
        grammar of a forced call. It ends at the first `end_tag`; `inside` (the prompt
        opened it) it starts with the output, else with `start_tag`. The parser reads the
        same text as reasoning and what follows as content, so the call after it is a call."""
        opening = "" if inside else regex_literal(cls.start_tag)
        end = regex_literal(cls.end_tag)
        stops = (*cls.end_alternatives, *cls.content_starts)
        if not stops:
            return f"think[lazy]: /{opening}(?s:.*){end}/\n"
        # The parser also ends the section at these, so its text cannot hold them: a
        # terminal (lazy is for rules only) that ends at the first end tag.
        others = "|".join(regex_literal(s) for s in stops)
        return (f"think: THINK_SECTION\nTHINK_SECTION: /{opening}(?s:.*){end}/"
                f" & ~/(?s:.*){end}(?s:.+)/ & ~/(?s:.*)({others})(?s:.*)/\n")

    @classmethod
    def starting(cls, thinking: bool) -> ReasoningParser:
        """A parser in the state `initial_thinking` gave: the frontend reads the prompt, the
        postproc step gets only the answer, not the whole prompt text."""
        parser = object.__new__(cls)
        parser._start(thinking)
        return parser

    def _start(self, thinking: bool) -> None:
        self._initial = thinking
        self._thinking = thinking
        self._section_start = thinking  # strip leading whitespace of this section
        self._held_ws = ""  # trailing whitespace of the reasoning, until more reasoning comes
        self._buf = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        """True while the output is inside a thinking block."""
        return self._thinking

    def feed(self, delta_text: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if delta_text:
            self._buf += delta_text
            self._run(final=False)
        return self._take()

    def finish(self) -> ReasoningDelta:
        if not self._finished:
            self._finished = True
            self._run(final=True)
            self._held_ws = ""  # the end of the reasoning: its trailing whitespace is layout
        return self._take()

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """One-shot: (reasoning, content), each None when empty. Fresh state, same prompt."""
        fresh = object.__new__(type(self))
        fresh._start(self._initial)
        first, last = fresh.feed(text), fresh.finish()
        return (first.reasoning + last.reasoning) or None, (first.content + last.content) or None

    def _run(self, final: bool) -> None:
        starts = (self.start_tag, *self.start_alternatives)
        ends = (self.end_tag, *self.end_alternatives)
        tags = (*starts, *ends, *self.content_starts)
        buf = self._buf
        while True:
            i, tag = find_first(buf, tags)
            if i < 0:
                break
            self._emit(buf[:i])
            buf = buf[i + len(tag):]
            if tag in self.content_starts:
                if self._thinking:
                    self._thinking, self._held_ws, self._section_start = False, "", True
                self._emit(tag)
            elif tag in ends and self._thinking:
                self._thinking = False
                self._held_ws = ""
                self._section_start = True
            elif tag in starts and not self._thinking:
                self._thinking = True
                self._section_start = True
        keep = 0 if final else partial_suffix_len(buf, tags)
        self._emit(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._section_start:
            text = text.lstrip()
            if not text:
                return
            self._section_start = False
        if not self._thinking:
            self._content.append(text)
            return
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            self._reasoning.append(body)

    def _take(self) -> ReasoningDelta:
        out = ReasoningDelta("".join(self._reasoning), "".join(self._content))
        self._reasoning, self._content = [], []
        return out
