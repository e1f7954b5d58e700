"""W3C Trace Context (https://www.w3.org/TR/trace-context/): reading and writing the
`traceparent` and `tracestate` headers, as every tier does at its edge.

Pure code without OpenTelemetry, so a process with tracing off pays an import of nothing.
Whatever a peer or a client sent is checked here: a malformed `traceparent` reads as none
(the request is traced as a new trace, never refused), a malformed or oversize `tracestate`
is dropped while its `traceparent` is kept, as the spec asks.
"""

from __future__ import annotations

import re

import msgspec

from shared.protocol import TraceContext

# version "00" is exactly 55 characters; a later version may add fields after a "-", which
# we skip. Longer than this is not a header anyone meant.
TRACEPARENT_MAX_CHARS = 256
# The spec's bounds on what a receiver must carry: 512 characters, 32 list members.
TRACESTATE_MAX_CHARS = 512
TRACESTATE_MAX_MEMBERS = 32

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_KEY = r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
_VALUE = r"[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
_MEMBER = re.compile(f"{_KEY}={_VALUE}")
SAMPLED = 0x01


class TraceParent(msgspec.Struct, frozen=True):
    """A checked trace context: the trace, the parent span in it, its flags (bit 0:
    sampled) and the vendors' tracestate (already checked; "" when none)."""

    trace_id: int
    span_id: int
    flags: int
    tracestate: str = ""

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def header(self) -> str:
        """The `traceparent` header naming this span (always version 00)."""
        return format_traceparent(self.trace_id, self.span_id, self.flags)

    def wire(self) -> TraceContext:
        return TraceContext(self.header(), self.tracestate)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"


def parse_traceparent(value: str | None, tracestate: str | None = None) -> TraceParent | None:
    """The context a `traceparent` names, or None when it is absent or malformed: an
    unknown version's extra fields are skipped, version ff, all-zero ids, upper case and
    any other shape are not a traceparent."""
    if not isinstance(value, str) or len(value) > TRACEPARENT_MAX_CHARS:
        return None
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == 0 or span_id == 0:
        return None
    return TraceParent(trace_id, span_id, int(flags_hex, 16), checked_tracestate(tracestate))


def checked_tracestate(value: str | None) -> str:
    """`tracestate` as sent when every member is well formed and it is within the spec's
    bounds; else "" (the spec lets a receiver drop it whole)."""
    if not isinstance(value, str) or not value or len(value) > TRACESTATE_MAX_CHARS:
        return ""
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    if len(members) > TRACESTATE_MAX_MEMBERS:
        return ""
    if not all(_MEMBER.fullmatch(m) for m in members):
        return ""
    keys = [m.split("=", 1)[0] for m in members]
    if len(set(keys)) != len(keys):
        return ""
    return ",".join(members)


def from_headers(headers: list[tuple[bytes, bytes]]) -> TraceParent | None:
    """The context of an HTTP request's raw ASGI headers: one `traceparent` (two are
    ambiguous: none), and its `tracestate` lines joined, as the spec combines them."""
    parents: list[str] = []
    states: list[str] = []
    for name, value in headers:
        if name == b"traceparent":
            parents.append(value.decode("latin-1"))
        elif name == b"tracestate":
            states.append(value.decode("latin-1"))
    if len(parents) != 1:
        return None
    return parse_traceparent(parents[0], ",".join(states))


def from_wire(context: TraceContext | None) -> TraceParent | None:
    """A peer's `EngineRequest.trace_context`, checked as a client's header would be."""
    if context is None:
        return None
    return parse_traceparent(context.traceparent, context.tracestate)
