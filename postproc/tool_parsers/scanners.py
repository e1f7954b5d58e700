"""Incremental bracket matchers: where does the JSON (or Python) value that starts here end?

They keep their position between calls, so text arriving a token at a time is scanned once,
not once per token. Each is used for one value; make a new one for the next.
"""

from __future__ import annotations

import re

_JSON_STRUCT = re.compile(r'[\[\]{}"]')
_JSON_IN_STRING = re.compile(r'["\\]')
_PY_STRUCT = re.compile(r"[\[\](){}\"'#]")


class JsonValueEnd:
    """Finds the end of a JSON object or array beginning at `start` (its `{` or `[`)."""

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.in_string = False

    def scan(self, text: str, stop: int | None = None) -> int | None:
        """Index just past the closing bracket, or None while the value is unfinished.
        `stop`: look only at text[:stop] (the rest is not decided yet); `pos` then tells
        how far the text is known to belong to the value."""
        i, n = self.pos, len(text) if stop is None else stop
        while True:
            if self.in_string:
                m = _JSON_IN_STRING.search(text, i, n)
                if m is None:
                    self.pos = n
                    return None
                j = m.start()
                if text[j] == "\\":
                    if j + 1 >= n:  # the escaped character has not arrived yet
                        self.pos = j
                        return None
                    i = j + 2
                    continue
                self.in_string = False
                i = j + 1
                continue
            m = _JSON_STRUCT.search(text, i, n)
            if m is None:
                self.pos = n
                return None
            j = m.start()
            c = text[j]
            i = j + 1
            if c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.pos = i
                    return i


class PythonValueEnd:
    """Finds the end of a Python bracketed expression beginning at `start` (its `[`).

    Knows single, double and triple-quoted strings with backslash escapes, and comments.
    """

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.quote: str | None = None

    def scan(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the value is unfinished (or
        the text ends where the next character decides, e.g. two quotes that may be three)."""
        i: int | None = self.pos
        n = len(text)
        while True:
            if self.quote is not None:
                i = self._in_string(text, i, n)
            else:
                m = _PY_STRUCT.search(text, i)
                if m is None:
                    self.pos = n
                    return None
                j = m.start()
                c = text[j]
                if c in "\"'":
                    i = self._open_string(text, j, n, c)
                elif c == "#":
                    i = self._past_comment(text, j)
                else:
                    i = j + 1
                    if c in "[({":
                        self.depth += 1
                    else:
                        self.depth -= 1
                        if self.depth <= 0:
                            self.pos = i
                            return i
            if i is None:
                return None  # waiting: `pos` says where to go on

    def _in_string(self, text: str, i: int, n: int) -> int | None:
        """Past the next escape or quote inside a string (closing it if it is the end);
        None while undecided."""
        q = self.quote
        j = _find_either(text, "\\", q[0], i)
        if j < 0:
            self.pos = n
            return None
        if text[j] == "\\":
            if j + 1 >= n:
                self.pos = j
                return None
            return j + 2
        if len(q) == 3:
            if j + 3 > n:
                self.pos = j  # may be the closing triple quote: wait
                return None
            if text.startswith(q, j):
                self.quote = None
                return j + 3
            return j + 1
        self.quote = None
        return j + 1

    def _open_string(self, text: str, j: int, n: int, c: str) -> int | None:
        """A quote at text[j] opens a string: single or triple."""
        if j + 3 > n and text[j:] == c * (n - j):
            self.pos = j  # "" could still become """: wait
            return None
        if text.startswith(c * 3, j):
            self.quote = c * 3
            return j + 3
        self.quote = c
        return j + 1

    def _past_comment(self, text: str, j: int) -> int | None:
        k = text.find("\n", j)
        if k < 0:
            self.pos = j
            return None
        return k + 1


def _find_either(text: str, a: str, b: str, start: int) -> int:
    i, j = text.find(a, start), text.find(b, start)
    if i < 0:
        return j
    if j < 0:
        return i
    return min(i, j)
