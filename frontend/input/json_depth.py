"""How deep JSON nests, measured without recursion, before anything recursive reads it.

msgspec's decoder, `json.loads` and our own walks over schemas and tool calls all recurse
once per level, and Python stops them near 1,000 levels with a RecursionError (a 500). So a
body's nesting is measured on its raw bytes first: strings are cut out (a bracket inside a
string nests nothing), the brackets that remain become +1 / -1, and the largest running sum
is the depth. A body with no more brackets than the limit is passed without a scan; a 1 MB
body full of them takes a few milliseconds (tests/unit/test_input_bounds.py measures it).
The slower walk that names the field runs only on the way to a 400.

Depth counts containers: `{}` is 1, `{"a": [1]}` is 2; a request body itself is level 1.
"""

from __future__ import annotations

import json
import re

import numpy as np

# A JSON string, or the unterminated rest of one: without the optional closing quote an
# unterminated string would be retried from every quote inside it (quadratic time).
_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"?'
_TOKENS = re.compile(_STRING + rb"|[\[\]{}:]", re.S)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_QUOTE = ord('"')
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_PATH_SEGMENTS = 6  # enough to name the field (`messages[0].tool_calls[0].function.x`)
_PATH_TOKENS = 100_000  # the walk that names the field stops here (about 0.1 s)
_KEY_CHARS = 64


class TooDeep(Exception):
    """JSON nested past the limit; `path` says where (`metadata.a[0]`, or "" at the top)."""

    def __init__(self, path: str, limit: int) -> None:
        super().__init__(f"nested deeper than {limit} levels at {path or 'the top level'}")
        self.path = path
        self.limit = limit


def max_depth(data: bytes) -> int:
    """The deepest nesting of containers in `data` (which need not be valid JSON)."""
    # Escapes first: a run of backslashes pairs up left to right, so dropping every pair of
    # backslashes, then every backslash-quote, leaves exactly the quotes around strings.
    if b'\\"' in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = np.frombuffer(data.translate(None, _NOT_STRUCTURE), dtype=np.uint8)
    if not structure.size:
        return 0
    in_string = np.bitwise_xor.accumulate(structure == _QUOTE, dtype=np.uint8)
    steps = _STEP[structure] * (1 - in_string.view(np.int8))  # brackets outside strings
    return int(np.cumsum(steps, dtype=np.int32).max())


def check_depth(data: bytes | str, limit: int) -> None:
    """Raises TooDeep when a container in `data` nests more than `limit` levels."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if data.count(b"[") + data.count(b"{") <= limit:
        return  # it cannot nest deeper than it has brackets
    if max_depth(data) > limit:
        raise TooDeep(_path_past(data, limit), limit)


def _path_past(data: bytes, limit: int) -> str:
    """The path to the first container opened past `limit` levels, its first segments; ""
    when the walk would take too long (an adversarial body: the 400 then names no field)."""
    frames: list[list] = []  # per open container: [is_object, key or index]
    last_string = b'""'
    end = 0  # where the previous token ended: array commas are counted in the gaps
    for n, match in enumerate(_TOKENS.finditer(data)):
        if n == _PATH_TOKENS:
            return ""
        if frames and not frames[-1][0]:
            frames[-1][1] += data.count(b",", end, match.start())
        token, end = match.group(), match.end()
        first = token[:1]
        if first == b'"':
            last_string = token
        elif first in b"[{":
            if len(frames) >= limit:
                return _format(frames)
            frames.append([first == b"{", None if first == b"{" else 0])
        elif first in b"]}":
            if frames:
                frames.pop()
        elif frames and first == b":":
            frames[-1][1] = _key(last_string)
    return ""


def _key(token: bytes) -> str:
    try:
        key = json.loads(token)
    except ValueError:
        key = token.decode("utf-8", "replace").strip('"')
    return key[:_KEY_CHARS]


def _format(frames: list[list]) -> str:
    path = ""
    for is_object, label in frames[:_PATH_SEGMENTS]:
        if is_object:
            if label is None:
                break
            path += f".{label}" if path else label
        else:
            path += f"[{label}]"
    return path
