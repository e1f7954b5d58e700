"""Formats where each call sits in a `<tool_call>` ... `</tool_call>` block (hermes,
qwen3_coder): the block's tags, how a forced call opens and follows another, and the loop
that finds the blocks; each format reads its own block bodies (`_block_calls`)."""

from __future__ import annotations

from typing import ClassVar

from postproc.markers import find_first
from postproc.tool_parsers.base import ToolParser


class TaggedBlockParser(ToolParser):
    open_tag: ClassVar[str] = "<tool_call>"
    close_tag: ClassVar[str] = "</tool_call>"
    delimiters = (open_tag, close_tag)
    begin_marker = open_tag
    begin_lark = '"<tool_call>"'
    next_call_lark = '"\\n<tool_call>"'

    def _reset(self) -> None:
        self._in_block = False
        self._search_from = 0  # inside a block: where the next tag search starts

    def _block_calls(self, body: str, terminated: bool) -> list[tuple[str, str]] | None:
        """The calls in one block's body, or None if it is not a valid call.

        `terminated` is False for a block the output ended inside (no close tag)."""
        raise NotImplementedError

    def _step(self, final: bool) -> bool:
        tags = (self.open_tag, self.close_tag)
        buf = self._buf
        if not self._in_block:
            tag = self._content_until(tags, final, hold=self.delimiters)
            if tag is None:
                return False
            if tag == self.open_tag:
                self._in_block = True
                self._search_from = 0
            return True  # a stray close tag is simply dropped
        # Inside a block: it ends at the close tag, or where the next block opens (a model
        # that forgot to close one), or at the end of the output.
        i, tag = find_first(buf, tags, self._search_from)
        if i < 0:
            if not final:
                self._search_from = max(0, len(buf) - max(len(t) for t in tags) + 1)
                return False
            body, rest, terminated = buf, "", False
        else:
            body, terminated = buf[:i], True
            rest = buf[i + len(tag):] if tag == self.close_tag else buf[i:]
        calls = self._block_calls(body, terminated)
        if calls:
            for name, arguments in calls:
                self._call(name, arguments)
        elif not terminated and self._truncated:
            self._dropped = True  # a call max_tokens cut short: its markup is not content
        else:
            self._text(body)  # not a call after all: content, without the tags
        self._buf = rest
        self._in_block = False
        return bool(rest) or not final
