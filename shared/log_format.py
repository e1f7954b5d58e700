"""How every sluice process logs: text (the default) or, with `--log-format json`, one JSON
object a line for log pipelines (Loki, Elastic, Cloud Logging), as llama-server writes.

One place for the whole concern: `setup_logging` (called once per process by `sluice`'s
main) installs the formatter on the root logger, routes Python warnings and uncaught
exceptions through it, and leaves the choice in the environment, so processes started
below this one (tensor-parallel ranks, the grammar checker's workers) log alike
(`setup_from_environment`). uvicorn's loggers propagate here too (`uvicorn_log_config`).

A JSON line carries `timestamp` (RFC 3339, UTC), `level`, `logger`, `message`, `role`
(serve / frontend / engine / postproc), `engine_id` where known, `request_id` and
`trace_id` when there is one, and `exception` when one is logged. The request id is a
record's `extra={"request_id": ...}`, else the request this task serves (`open_request`,
`name_request`: the frontend's HTTP requests). `trace_id` is the hook for tracing: whoever
starts a request's span sets `trace_id` (the contextvar); unset, the key is left out.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import os
import sys
import threading

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What setup_logging leaves for the processes this one starts (setup_from_environment).
FORMAT_ENV, LEVEL_ENV, ROLE_ENV = "SLUICE_LOG_FORMAT", "SLUICE_LOG_LEVEL", "SLUICE_LOG_ROLE"


class RequestContext:
    """The request a task serves. Mutable on purpose: the HTTP middleware opens it before the
    route runs and the route names the request later; tasks the route starts copy the
    context, so they share this one object and see the name."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str | None = None) -> None:
        self.request_id = request_id


_request: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "sluice_request", default=None)
# The trace of the request being served, as 32 hex digits: set by the tracing work where a
# request's span starts; None: no trace, the key is left out.
trace_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "sluice_trace_id", default=None)
# Fields of every line of this process: role, engine_id (set_process_fields).
_process_fields: dict[str, object] = {}


def open_request(request_id: str | None = None) -> contextvars.Token:
    """A new request for this task (and the tasks it starts); reset with the token."""
    return _request.set(RequestContext(request_id))


def close_request(token: contextvars.Token) -> None:
    _request.reset(token)


def name_request(request_id: str) -> None:
    """The request this task serves is `request_id` (from now on, in its log lines). Only
    inside an opened request: a task outside one (a test, a sweep) keeps no stale name."""
    current = _request.get()
    if current is not None:
        current.request_id = request_id


def current_request_id() -> str | None:
    current = _request.get()
    return current.request_id if current is not None else None


def set_process_fields(**fields: object) -> None:
    """Fields every later line of this process carries (None drops one), e.g. the
    engine's id once its config is known."""
    for key, value in fields.items():
        if value is None:
            _process_fields.pop(key, None)
        else:
            _process_fields[key] = value


# A record's own fields the JSON line copies when set (`extra=`).
_EXTRA_FIELDS = ("engine_id", "request_id", "trace_id")


class JsonFormatter(logging.Formatter):
    """One JSON object a line; a message or traceback's newlines are escaped inside it."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "timestamp": _rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **_process_fields,
        }
        request_id = current_request_id()
        if request_id is not None:
            line["request_id"] = request_id
        trace = trace_id.get()
        if trace is not None:
            line["trace_id"] = trace
        for key in _EXTRA_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                line[key] = value
        if record.name == "uvicorn.access":
            line.update(_access_fields(record.args))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def _rfc3339(created: float) -> str:
    moment = datetime.datetime.fromtimestamp(created, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _access_fields(args) -> dict[str, object]:
    """uvicorn's access line as fields: its arguments are (client, method, path with query,
    HTTP version, status)."""
    if not isinstance(args, tuple) or len(args) != 5:
        return {}
    client, method, path, version, status = args
    return {"client_addr": client, "method": method, "path": path, "http_version": version,
            "status": status}


def setup_logging(level: str, log_format: str = "text", role: str | None = None,
                  text_format: str = TEXT_FORMAT, **fields: object) -> None:
    """The root logger's one handler (stderr) in `log_format`; Python warnings and uncaught
    exceptions through it; the choice left in the environment for child processes."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    set_process_fields(role=role, **fields)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(text_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)  # warnings.warn: a log line, not a raw stderr write
    if log_format == "json":
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
    os.environ.update({FORMAT_ENV: log_format, LEVEL_ENV: level, ROLE_ENV: role or ""})


def setup_from_environment(**fields: object) -> None:
    """In a process started by a sluice process (a tensor-parallel rank, a grammar-check
    worker): log as the parent does, or as text at info if it did not say."""
    setup_logging(os.environ.get(LEVEL_ENV, "info"), os.environ.get(FORMAT_ENV, "text"),
                  os.environ.get(ROLE_ENV) or None, **fields)


def is_json() -> bool:
    """Whether this process logs JSON (its start-up refusals are then log lines too)."""
    return os.environ.get(FORMAT_ENV) == "json"


def uvicorn_log_config() -> dict:
    """uvicorn's `log_config`: its loggers keep no handlers of their own and propagate to
    the root's, so its error and access lines come in this process's format."""
    return {"version": 1, "disable_existing_loggers": False,
            "loggers": {name: {"handlers": [], "propagate": True}
                        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}}


def _log_uncaught(kind, value, traceback) -> None:
    if issubclass(kind, KeyboardInterrupt):
        return sys.__excepthook__(kind, value, traceback)
    logging.getLogger("sluice").critical("uncaught %s: %s", kind.__name__, value,
                                         exc_info=(kind, value, traceback))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("sluice").critical(
        "uncaught %s in thread %s: %s", args.exc_type.__name__, name, args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
