"""`--api-keys-file` and `--rate-limit-store-failure` (frontend.http.key_table,
frontend.http.key_limits; docs/operations.md "Many teams on one deployment")."""

from __future__ import annotations

import argparse
import os

from frontend.http.key_table import KeysFileError, KeyTable


def _keys_file(path: str) -> str:
    """The file, read once here so a bad one stops the start with one line naming the
    entry (argparse's error), before any process starts."""
    try:
        KeyTable(path, [])
    except (OSError, KeysFileError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
    return path


def add_key_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--api-keys-file", type=_keys_file, default=None, metavar="PATH",
                   help="a YAML or JSON file of API keys, one entry per team, each with its "
                        "own limits (requests and tokens per minute, requests in flight, max "
                        "tokens per request, priority, models, expiry); reloaded on SIGHUP "
                        "and when the file changes (default: none)")
    g.add_argument("--rate-limit-store-failure", choices=["open", "closed"], default="open",
                   help="when the state store that holds the keys' budgets does not answer: "
                        "admit the request (open) or refuse it with a 503 (closed); logged "
                        "and counted either way (default: %(default)s)")


def key_config(args) -> dict:
    path = args.api_keys_file
    return dict(api_keys_file=os.path.abspath(path) if path else None,
                rate_limit_store_failure=args.rate_limit_store_failure)


def key_argv(args) -> list[str]:
    argv = ["--rate-limit-store-failure", args.rate_limit_store_failure]
    return argv + (["--api-keys-file", args.api_keys_file] if args.api_keys_file else [])
