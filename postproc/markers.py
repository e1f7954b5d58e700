"""Finding delimiters in streamed text, for every parser that holds text back while a
delimiter may still be arriving: the tool-call parsers, the reasoning parsers and Harmony's
channel reader.
"""

from __future__ import annotations


def partial_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """The earliest occurrence of any marker at or after `start`: (index, marker) or (-1, None)."""
    best, which = -1, None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, marker
    return best, which
