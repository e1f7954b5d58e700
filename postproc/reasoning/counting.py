"""Counting the output tokens a reasoning parser reads as reasoning (usage's reasoning_tokens).

The parsers read text, but usage counts tokens, so each token's text is fed separately: a
token is reasoning when the parser is inside a reasoning section both before and after
reading its text. The markers that open and close a section (`<think>`, `</think>`, Harmony's
channel headers, `<|end|>`) change the state, so they count in completion_tokens but not as
reasoning, as vLLM counts them; every other token of a section does, layout whitespace too.

The parser reads the text stop strings let through, which may lag behind the tokens (text
that could begin a stop string is held back) and is cut where one matches. That text is a
prefix of the tokens' texts, so the reader splits it at the tokens' boundaries: a token is
judged once all its text has been read, and a token cut off by a stop string never is.
"""

from __future__ import annotations

from collections import deque

from postproc.reasoning.base import ReasoningDelta, ReasoningParser


class _Token:
    __slots__ = ("inside", "size", "unread")

    def __init__(self, unread: int, size: int) -> None:
        self.unread = unread  # characters of its text the parser has not read yet
        self.size = size  # tokens it stands for (0: text from no token, a final flush)
        self.inside: bool | None = None  # the parser's state before its first character


class CountingReader:
    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning_tokens = 0
        self._queue: deque[_Token] = deque()

    def tokens(self, texts: list[tuple[str, int]]) -> None:
        """New tokens' texts, as the detokenizer gave them: (text, number of tokens)."""
        self._queue.extend(_Token(len(text), size) for text, size in texts)

    def feed(self, text: str) -> ReasoningDelta:
        """The next text that stop strings let through (a prefix of the tokens' texts)."""
        parts: list[ReasoningDelta] = []
        pos = 0
        while self._queue:
            token = self._queue[0]
            if token.inside is None:
                token.inside = self.parser.in_reasoning
            take = min(token.unread, len(text) - pos)
            if take:
                parts.append(self.parser.feed(text[pos:pos + take]))
                pos += take
                token.unread -= take
            if token.unread:
                break  # the rest of its text is still held back
            self._queue.popleft()
            if token.inside and self.parser.in_reasoning:
                self.reasoning_tokens += token.size
        if pos < len(text):  # (never: the text is theirs) read it all the same
            parts.append(self.parser.feed(text[pos:]))
        return _joined(parts)

    def finish(self) -> ReasoningDelta:
        """At the end of the output; tokens whose text was never read are not counted."""
        self._queue.clear()
        return self.parser.finish()


def _joined(parts: list[ReasoningDelta]) -> ReasoningDelta:
    return ReasoningDelta("".join(d.reasoning for d in parts), "".join(d.content for d in parts))
