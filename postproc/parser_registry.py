"""Parsers by name: the one lookup behind `--tool-call-parser` and `--reasoning-parser`.

Each parser class names itself (`name`, a ClassVar); a registry maps those names to the
classes, and an unknown name is a ValueError that lists the known ones, so a start-up check or
a request's parser option can say what would have worked.
"""

from __future__ import annotations

from typing import Any, TypeVar

Parser = TypeVar("Parser")


def registry(*classes: Any) -> dict[str, Any]:
    """The classes by the name each gives itself."""
    return {cls.name: cls for cls in classes}


def lookup(parsers: dict[str, Parser], name: str, kind: str) -> Parser:
    """The parser registered as `name`; ValueError naming the known ones if none. `kind`
    says which registry, in the message ("tool-call parser")."""
    try:
        return parsers[name]
    except KeyError:
        known = ", ".join(sorted(parsers))
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None
