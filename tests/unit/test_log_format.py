"""--log-format (issue 50): the JSON formatter's fields, the request context it reads, and
the flag's boundaries at start (an unknown value is one line; under json even start-up
refusals and argparse's errors are JSON lines)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared import log_format
from shared.log_format import JsonFormatter
from sluice import cli

ROOT = Path(__file__).resolve().parents[2]
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _record(name="sluice.engine", msg="hello %s", args=("there",), **kw) -> logging.LogRecord:
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, kw.pop("exc", None))
    record.__dict__.update(kw)
    return record


def test_a_line_is_one_object_with_the_fields():
    line = JsonFormatter().format(_record())
    assert "\n" not in line
    fields = json.loads(line)
    assert RFC3339_UTC.match(fields["timestamp"]), fields
    assert (fields["level"], fields["logger"], fields["message"]) == (
        "WARNING", "sluice.engine", "hello there")
    assert "request_id" not in fields and "trace_id" not in fields and "exception" not in fields


def test_the_request_and_trace_come_from_the_context_and_extra_wins():
    token = log_format.open_request("given")
    trace = log_format.trace_id.set("0af7651916cd43dd8448eb211c80319c")
    try:
        fields = json.loads(JsonFormatter().format(_record()))
        assert fields["request_id"] == "given"
        assert fields["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
        log_format.name_request("chatcmpl-given")  # the route names it later
        assert json.loads(JsonFormatter().format(_record()))["request_id"] == "chatcmpl-given"
        own = json.loads(JsonFormatter().format(_record(request_id="r-9", engine_id="e-1")))
        assert (own["request_id"], own["engine_id"]) == ("r-9", "e-1")
    finally:
        log_format.trace_id.reset(trace)
        log_format.close_request(token)
    log_format.name_request("outside")  # no request open: nothing to name, nothing kept
    assert "request_id" not in json.loads(JsonFormatter().format(_record()))


def test_process_fields_an_exception_and_an_access_line():
    log_format.set_process_fields(role="engine", engine_id="engine-3")
    try:
        try:
            raise ValueError("bad\nthing")
        except ValueError:
            fields = json.loads(JsonFormatter().format(_record(exc=sys.exc_info())))
        assert (fields["role"], fields["engine_id"]) == ("engine", "engine-3")
        assert "ValueError: bad\nthing" in fields["exception"]
    finally:
        log_format.set_process_fields(role=None, engine_id=None)
    access = json.loads(JsonFormatter().format(_record(
        "uvicorn.access", '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "POST", "/v1/chat/completions?x=1", "1.1", 400))))
    assert access["message"] == '127.0.0.1:5 - "POST /v1/chat/completions?x=1 HTTP/1.1" 400'
    assert (access["method"], access["path"], access["status"]) == (
        "POST", "/v1/chat/completions?x=1", 400)
    assert "role" not in access


def test_an_unknown_format_is_refused_while_parsing():
    with pytest.raises(SystemExit, match=r"^sluice: --log-format yaml: expected one of text, "
                                         r"json$"):
        cli.parse_args(["engine", "--log-format", "yaml"])
    assert cli.parse_args(["postproc", "--log-format", "json"]).log_format == "json"
    assert cli.parse_args(["frontend"]).log_format == "text"
    with pytest.raises(ValueError):
        log_format.setup_logging("info", "JSON")


def _run(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _sluice(*argv: str) -> subprocess.Popen:
    return _run(f"import sys; from sluice.cli import main; sys.exit(main({list(argv)!r}))")


def test_under_json_every_line_parses_refusals_warnings_and_crashes_included():
    runs = {
        "yaml": _sluice("serve", "--log-format", "yaml"),
        "device": _sluice("engine", "--log-format", "json", "--device", "tpu"),
        "flag": _sluice("frontend", "--log-format=json", "--no-such-flag"),
        "crash": _run("import warnings; from shared.log_format import setup_logging; "
                      "setup_logging('info', 'json', 'engine'); warnings.warn('careful'); "
                      "raise RuntimeError('boom')"),
    }
    out = {name: (p.communicate(timeout=120)[0], p.returncode) for name, p in runs.items()}
    text, code = out["yaml"]
    assert code != 0 and text.strip().splitlines() == [
        "sluice: --log-format yaml: expected one of text, json"]
    for name in ("device", "flag", "crash"):
        text, code = out[name]
        lines = [json.loads(line) for line in text.strip().splitlines()]
        assert code != 0 and lines, name
        assert lines[-1]["level"] in ("ERROR", "CRITICAL"), lines
    assert "--device tpu: not a device" in out["device"][0]
    assert "unrecognized arguments: --no-such-flag" in out["flag"][0]
    crash = [json.loads(line) for line in out["crash"][0].strip().splitlines()]
    assert [c["logger"] for c in crash] == ["py.warnings", "sluice"]
    assert "careful" in crash[0]["message"] and crash[0]["role"] == "engine"
    assert "RuntimeError: boom" in crash[1]["exception"]


def test_a_traced_request_names_its_trace_on_its_log_lines():
    """The frontend's request span sets the trace id the JSON lines carry, and only inside."""
    from opentelemetry.sdk.trace import TracerProvider

    from frontend.pipeline.tracing import request_span
    from shared.trace_context import parse_traceparent
    from shared.tracing import Tracing

    parent = parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    with request_span(Tracing(TracerProvider(), "sluice-frontend"), "POST /x", parent, {}):
        inside = json.loads(JsonFormatter().format(_record()))
    outside = json.loads(JsonFormatter().format(_record()))
    assert inside["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert "trace_id" not in outside
