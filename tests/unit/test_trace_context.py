"""W3C trace context at every tier's edge (shared.trace_context): what a `traceparent` and a
`tracestate` must look like to be followed, and that anything else is read as no context
(a new trace), never an error."""

import pytest

from shared.protocol import TraceContext
from shared.trace_context import (
    TRACEPARENT_MAX_CHARS,
    TRACESTATE_MAX_CHARS,
    TRACESTATE_MAX_MEMBERS,
    checked_tracestate,
    from_headers,
    from_wire,
    parse_traceparent,
)

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
VALID = f"00-{TRACE}-{SPAN}-01"


def test_a_valid_traceparent_round_trips():
    parent = parse_traceparent(VALID, "congo=t61rcWkgMzE")
    assert (parent.trace_id, parent.span_id, parent.flags) == (int(TRACE, 16), int(SPAN, 16), 1)
    assert parent.sampled and parent.header() == VALID
    assert parent.wire() == TraceContext(VALID, "congo=t61rcWkgMzE")
    assert not parse_traceparent(f"00-{TRACE}-{SPAN}-00").sampled
    assert parse_traceparent(f"  {VALID}\t").header() == VALID  # header whitespace


@pytest.mark.parametrize("value", [
    None, 55, b"00-x", "", "00", VALID[:-1], VALID + "0",
    f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
    f"00-{TRACE.upper()}-{SPAN}-01",  # lower-case hex only
    f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
    f"00-{TRACE[:-1]}g-{SPAN}-01", f"00_{TRACE}_{SPAN}_01", f"0-{TRACE}-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-1", f"00-{TRACE}-{SPAN}",
    f"01-{TRACE}-{SPAN}-01x",  # a later version's extra fields follow a dash
    "01-" + TRACE + "-" + SPAN + "-01-" + "a" * TRACEPARENT_MAX_CHARS,  # oversize
])
def test_malformed_traceparents_are_no_context(value):
    assert parse_traceparent(value) is None


def test_a_later_version_is_read_as_far_as_version_00_goes():
    assert parse_traceparent(f"01-{TRACE}-{SPAN}-01").span_id == int(SPAN, 16)
    parent = parse_traceparent(f"cc-{TRACE}-{SPAN}-01-what-the-future-holds")
    assert parent is not None and parent.header() == VALID  # we answer in version 00


def test_tracestate_is_kept_only_when_well_formed():
    assert checked_tracestate("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE") == \
        "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
    assert checked_tracestate("tenant@vendor=x,,a=b") == "tenant@vendor=x,a=b"
    members = ",".join(f"k{i}=v" for i in range(TRACESTATE_MAX_MEMBERS))
    assert checked_tracestate(members) == members
    for bad in [None, "", "novalue", "=v", "Upper=v", "a=b,a=c", "a=b=c", "a=b\tc", "a=\u00e9",
                "a=" + "v" * 257, members + ",one=more",
                "k=" + "v" * (TRACESTATE_MAX_CHARS - 1)]:
        assert checked_tracestate(bad) == "", bad
    # A bad tracestate costs only itself: the traceparent is still followed.
    assert parse_traceparent(VALID, "a=b,a=c") == parse_traceparent(VALID)


def test_headers_and_wire():
    assert from_headers([(b"traceparent", VALID.encode()), (b"tracestate", b"a=1"),
                         (b"tracestate", b"b=2")]).tracestate == "a=1,b=2"
    # Two traceparents are ambiguous: a new trace.
    assert from_headers([(b"traceparent", VALID.encode())] * 2) is None
    assert from_headers([(b"tracestate", b"a=1")]) is None
    assert from_headers([(b"traceparent", b"\xff\xfe")]) is None
    assert from_wire(None) is None
    assert from_wire(TraceContext("garbage", "a=1")) is None
    assert from_wire(TraceContext(VALID)).span_id == int(SPAN, 16)
