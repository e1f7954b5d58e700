"""The frontend's HTTP-server and limit flags: uvicorn's settings, CORS, API keys, the
request bounds (frontend.input.input_bounds), and how `sluice serve` forwards them.

Split from `flags.py` (issue 49) because this group travels together: the flags, the
`FrontendConfig` fields they fill (`limit_config`) and the argv `serve` rebuilds (`limit_argv`).
"""

from __future__ import annotations

import argparse
import json
import os

from frontend.http.key_flags import add_key_arguments, key_argv, key_config
from shared.command_line import int_at_least, positive_number, seconds
from shared.config import OPEN_PATHS


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP server (uvicorn)")
    g.add_argument("--root-path", default="",
                   help="the path prefix a proxy in front strips, for URLs the server "
                        "writes (ASGI root_path; default: none)")
    g.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix domain socket instead of --host/--port")
    g.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file")
    g.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="TLS: CA certificates for client certificates")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="TLS: client certificates: 0 none, 1 optional, 2 required "
                        "(Python's ssl.CERT_*; default: %(default)s)")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="the HTTP server's own log level (default: --log-level)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per HTTP request (vLLM's; they are on by default, "
                        "at info, in --log-format's format)")


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("frontend limits and security")
    g.add_argument("--api-key", action="append", default=[], dest="api_keys", metavar="KEY",
                   help="require this key (Authorization: Bearer KEY, or x-api-key: KEY) on "
                        f"every route but {', '.join(OPEN_PATHS)}; repeat for several "
                        "keys; SLUICE_API_KEY adds comma-separated keys (default: none)")
    add_key_arguments(g)
    g.add_argument("--allowed-origins", nargs="+", action="extend", default=[],
                   metavar="ORIGIN",
                   help="CORS: origins browsers may call from, or '*' (default: none, so no "
                        "CORS headers); a JSON list as vLLM takes it works too")
    g.add_argument("--allowed-methods", nargs="+", action="extend", default=None,
                   metavar="METHOD", help="CORS: allowed methods (default: *)")
    g.add_argument("--allowed-headers", nargs="+", action="extend", default=None,
                   metavar="HEADER", help="CORS: allowed request headers (default: *)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let browsers send cookies and authorization headers")
    g.add_argument("--max-request-body-bytes", type=int_at_least(1), default=32 * 2**20,
                   help="larger request bodies get a 413 (default: 32 MiB)")
    g.add_argument("--max-queued-requests", "--max-num-queued-reqs", type=int_at_least(1),
                   default=None,
                   help="requests this frontend has accepted that have not started generating; "
                        "beyond it new ones get a 503 with Retry-After (default: no cap; "
                        "--max-num-queued-reqs: vLLM's name, counted per frontend here)")
    g.add_argument("--request-timeout", type=positive_number, default=None,
                   help="seconds a request may take from arrival to its last token; then it "
                        "ends with a 504 error and is aborted in the engine (default: none)")
    g.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                   help="on SIGTERM or SIGINT, seconds in-flight requests may still run while "
                        "new ones get a 503; then the rest end with an error "
                        "(default: %(default)s)")
    _add_bound_arguments(p)


# Bounds per request (frontend.input.input_bounds): flag -> (FrontendConfig field, default, help).
_BOUNDS = {
    "--max-json-depth": ("max_json_depth", 64, "levels any JSON in a request may nest: the "
                         "body, and JSON strings such as schemas and tool-call arguments"),
    "--max-n": ("max_n", 128, "largest n and best_of (engine requests per prompt)"),
    "--max-prompts-per-request": ("max_prompts_per_request", 128,
                                  "prompts in one /v1/completions batch"),
    "--max-messages": ("max_messages", 2048, "messages in one chat request"),
    "--max-tools": ("max_tools", 128, "tools in one request"),
    "--max-stop-strings": ("max_stop_strings", 64, "stop strings in one request"),
}


def _add_bound_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("frontend bounds per request (past one: a 400 naming the field)")
    for flag, (dest, default, what) in _BOUNDS.items():
        g.add_argument(flag, type=int_at_least(1), default=default, dest=dest,
                       help=f"{what} (default: %(default)s)")


def _listed(values: list[str] | None, default: list[str]) -> list[str]:
    """Flag values, where one may also be a JSON list (vLLM's `--allowed-origins '["*"]'`)."""
    if not values:
        return default
    out: list[str] = []
    for value in values:
        out.extend(json.loads(value) if value.startswith("[") else [value])
    return out


def api_keys(args) -> list[str]:
    from_env = [k.strip() for k in os.environ.get("SLUICE_API_KEY", "").split(",")]
    return list(dict.fromkeys(k for k in [*args.api_keys, *from_env] if k))


def limit_config(args) -> dict:
    return dict(
        api_keys=api_keys(args), allowed_origins=_listed(args.allowed_origins, []),
        allowed_methods=_listed(args.allowed_methods, ["*"]),
        allowed_headers=_listed(args.allowed_headers, ["*"]),
        allow_credentials=args.allow_credentials,
        max_request_body_bytes=args.max_request_body_bytes,
        max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        **{dest: getattr(args, dest) for dest, _, _ in _BOUNDS.values()},
        **key_config(args),
    )


def limit_argv(args) -> list[str]:
    """The limit flags for the frontend `serve` starts; API keys go by environment instead,
    so they do not show up twice in the process list."""
    argv = ["--max-request-body-bytes", str(args.max_request_body_bytes),
            "--shutdown-timeout", str(args.shutdown_timeout)]
    for flag, (dest, _, _) in _BOUNDS.items():
        argv += [flag, str(getattr(args, dest))]
    for flag, values in (("--allowed-origins", args.allowed_origins),
                         ("--allowed-methods", args.allowed_methods),
                         ("--allowed-headers", args.allowed_headers)):
        if values:
            argv += [flag, *values]
    for flag, value in (("--max-queued-requests", args.max_queued_requests),
                        ("--request-timeout", args.request_timeout)):
        if value is not None:
            argv += [flag, str(value)]
    if args.allow_credentials:
        argv.append("--allow-credentials")
    return argv + key_argv(args)
