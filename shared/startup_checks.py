"""The one pass of start-up checks: a flag no process could run with stops `sluice` before
anything loads, with one line naming the flag and what to do instead (never a traceback).

`sluice serve` runs the pass for every process it will start, before it starts any, so a
mistake costs a second rather than a model load; `engine`, `frontend` and `postproc` run
the part that is theirs. Here: the error and the checks of more than one tier (or none);
the engine's own are in `engine/process/flags.py`, the frontend's flags in `frontend/http/flags.py`,
and each command's pass is its `Command.check` (`sluice.cli.check_startup`). Checks that
need the model loaded (the KV cache fitting one sequence, say) stay in the engine and fail
there the same way, as a `StartupError`.
"""

from __future__ import annotations

import socket


class StartupError(SystemExit):
    """A start-up mistake: `sluice: <flag> <value>: <what is wrong>; <what to do>`. A
    SystemExit, so wherever it is raised the process prints that one line and exits 1."""

    def __init__(self, message: str) -> None:
        super().__init__(f"sluice: {message}")


def check_model(args) -> None:
    """--model and --tokenizer name something there (a file, a folder, a cached Hub id)."""
    from shared.model_source import resolve_model_path

    custom = getattr(args, "tokenizer_mode", "auto") == "custom"
    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if flag == "--tokenizer" and (value is None or custom):  # custom: a registered name
            continue
        try:
            resolve_model_path(value, args.revision, args.download_dir)
        except ValueError as exc:
            raise StartupError(f"{flag} {value}: {exc}") from None
    check_tokenizer_mode(args)


def check_tokenizer_mode(args) -> None:
    """--tokenizer-mode can load this tokenizer (mistral: its files and mistral-common;
    custom: a registered name), before any process starts loading."""
    from shared.model_source import is_gguf, resolve_model_path
    from shared.tokenizer_modes import (
        TokenizerModeError,
        custom_tokenizer_class,
        resolve_tokenizer_mode,
    )

    mode = getattr(args, "tokenizer_mode", "auto")
    try:
        if mode == "custom":
            if args.tokenizer is None:
                raise TokenizerModeError("--tokenizer-mode custom needs --tokenizer NAME, a "
                                         "registered tokenizer")
            custom_tokenizer_class(args.tokenizer)
            return
        path = resolve_model_path(args.tokenizer or args.model, args.revision,
                                  args.download_dir)
        if is_gguf(path) and mode not in ("auto", "hf", "slow"):
            raise TokenizerModeError(f"--tokenizer-mode {mode}: a .gguf file carries an HF "
                                     "tokenizer; use auto or hf")
        if not is_gguf(path):
            resolve_tokenizer_mode(path, mode)
    except TokenizerModeError as exc:
        raise StartupError(str(exc)) from None


def check_generation_config(args) -> None:
    """A bad --generation-config or --override-generation-config (the frontend loads them
    again when it starts)."""
    from shared.generation_config import load_generation_defaults
    from shared.model_source import resolve_model_path

    try:
        load_generation_defaults(resolve_model_path(args.model, args.revision,
                                                    args.download_dir),
                                 args.generation_config, args.override_generation_config)
    except ValueError as e:
        raise StartupError(str(e)) from None


def check_listen_address(args) -> None:
    """--host/--port can be listened on: taken, the frontend would fail only once its
    tokenizer has loaded (and under serve, beside a loading engine)."""
    if args.uds:
        return
    try:
        infos = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise StartupError(f"--host {args.host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            raise StartupError(f"--host {args.host} --port {args.port}: cannot listen there "
                               f"({exc.strerror}); pick another --port, or stop what holds "
                               "it") from None
