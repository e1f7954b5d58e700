"""The Harmony format (gpt-oss) read from streamed text: which message each piece belongs to.

A gpt-oss turn is a run of messages, each a header and a body:

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

(the prompt ends with `<|start|>assistant`, so the first header is only its continuation:
a channel, maybe a recipient `to=...` before it). The markers are special tokens; the
detokenizer keeps them for the Harmony parsers (postproc.processor.special_ids_to_skip).

`HarmonyReader` is a state machine on text: `feed` pieces in any split, `finish` at the end;
it calls its sink with what can no longer change, so any split gives the same calls. A body
goes where its header sends it (`route`): a recipient `functions.NAME` makes it a tool call's
arguments whatever the channel; another recipient (a built-in tool such as `python`) or the
`analysis` channel makes it reasoning; anything else (`final`, `commentary` without a
recipient: a preamble, an unknown channel) is content. Text that is not inside any message
(a model that writes no header at all) is content too.
"""

from __future__ import annotations

import re

import msgspec

from postproc.markers import find_first, partial_suffix_len

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_ENDS = (END, CALL, RETURN)

REASONING, CONTENT, TOOL_CALL = "reasoning", "content", "call"
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


class Header(msgspec.Struct, frozen=True):
    channel: str | None
    recipient: str | None

    @classmethod
    def read(cls, text: str) -> Header:
        """A header's text (markers included, `<|message|>` not) -> its channel and
        recipient (`to=...`, which Harmony lets stand before or after the channel)."""
        channel = _CHANNEL_NAME.search(text)
        recipient = _RECIPIENT.search(text)
        return cls(channel.group(1) if channel else None,
                   recipient.group(1) if recipient else None)

    @property
    def route(self) -> str:
        if self.recipient is not None:
            return TOOL_CALL if self.recipient.startswith(FUNCTIONS) else REASONING
        return REASONING if self.channel == "analysis" else CONTENT

    @property
    def function(self) -> str:
        """The called function's name (route TOOL_CALL)."""
        return (self.recipient or "")[len(FUNCTIONS):]


class HarmonySink:
    """What a reader reports; the parsers implement it."""

    def text(self, route: str, text: str) -> None:  # REASONING or CONTENT
        raise NotImplementedError

    def open_call(self, name: str) -> None:
        raise NotImplementedError

    def call_args(self, fragment: str) -> None:
        raise NotImplementedError

    def close_call(self) -> None:
        raise NotImplementedError


# Where the reader stands: deciding whether the output opens with a header (the prompt's
# `<|start|>assistant` wants its continuation), inside a header, or inside a body.
_OPENING, _HEADER, _BODY = "opening", "header", "body"


class HarmonyReader:
    def __init__(self, sink: HarmonySink, *, opening: bool = True) -> None:
        """`opening`: the text starts where a header may continue the prompt's
        `<|start|>assistant` (the model's own output); False: it starts as content."""
        self._sink = sink
        self._mode = _OPENING if opening else _BODY
        self._route = CONTENT
        self._buf = ""

    @property
    def route(self) -> str:
        """Where text now goes (REASONING inside an analysis message)."""
        return self._route

    def feed(self, text: str) -> None:
        self._buf += text
        while self._step(final=False):
            pass

    def finish(self) -> None:
        while self._step(final=True):
            pass
        if self._route == TOOL_CALL:  # the call's <|call|> was the stop token
            self._sink.close_call()
            self._route = CONTENT

    def _step(self, final: bool) -> bool:
        if not self._buf:
            return False
        if self._mode == _OPENING:
            return self._opening(final)
        if self._mode == _HEADER:
            return self._header(final)
        return self._body(final)

    def _opening(self, final: bool) -> bool:
        """A header goes on from the prompt's role when the output starts with a marker or
        a recipient (`<|channel|>...`, ` to=functions.f<|channel|>...`); else it is text."""
        buf = self._buf
        rest = buf.lstrip()
        if rest.startswith(MARKERS) or rest.startswith("to="):
            self._mode = _HEADER
            return True
        undecided = not rest or any(m.startswith(rest) for m in (*MARKERS, "to="))
        if undecided and not final:
            return False
        self._mode = _BODY
        return True

    def _header(self, final: bool) -> bool:
        buf = self._buf
        i, marker = find_first(buf, (MESSAGE, START, *_ENDS))
        if i < 0:
            if final:  # a header the output ended inside: not a message, nothing to show
                self._buf = ""
            return False
        if marker == MESSAGE:
            header = Header.read(buf[:i])
            self._route = header.route
            if self._route == TOOL_CALL:
                self._sink.open_call(header.function)
            self._mode = _BODY
        elif marker != START:  # a message ended before its header did: dropped
            self._mode, self._route = _BODY, CONTENT
        # (START: a new header begins; the unfinished one is dropped.)
        self._buf = buf[i + len(marker):]
        return True

    def _body(self, final: bool) -> bool:
        buf = self._buf
        i, marker = find_first(buf, MARKERS)
        if i < 0:
            keep = 0 if final else partial_suffix_len(buf, MARKERS)
            self._emit(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit(buf[:i])
        if marker in (START, CHANNEL, *_ENDS):  # the message is over
            if self._route == TOOL_CALL:
                self._sink.close_call()
            self._route = CONTENT
        if marker in (START, CHANNEL):
            self._mode = _HEADER
            # The channel marker belongs to the header it opens (the channel follows it).
            self._buf = buf[i:] if marker == CHANNEL else buf[i + len(START):]
            return True
        self._buf = buf[i + len(marker):]  # an end, or a stray <|message|> / <|constrain|>
        return True

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._route == TOOL_CALL:
            self._sink.call_args(text)
        else:
            self._sink.text(self._route, text)
