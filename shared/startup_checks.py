"""The one pass of start-up checks: a flag no process could run with stops `sluice` before
anything loads, with one line naming the flag and what to do instead (never a traceback).

`sluice serve` runs the pass for every process it will start, before it starts any, so a
mistake costs a second rather than a model load; `engine`, `frontend` and `postproc` run
the part that is theirs. Checks that need the model loaded (the KV cache fitting one
sequence, say) stay in the engine and fail there the same way, as a `StartupError`.
"""

from __future__ import annotations

import os
import socket


class StartupError(SystemExit):
    """A start-up mistake: `sluice: <flag> <value>: <what is wrong>; <what to do>`. A
    SystemExit, so wherever it is raised the process prints that one line and exits 1."""

    def __init__(self, message: str) -> None:
        super().__init__(f"sluice: {message}")


def check_startup(args) -> None:
    """Every check the command's processes need, in the order a user would fix them."""
    command = args.command
    if command in ("serve", "engine", "frontend", "postproc"):
        check_model(args)
    if command in ("serve", "engine"):
        check_cpu_isa()
        check_device(args.device)
        check_batch_invariant(args)
    if command in ("serve", "frontend"):
        check_frontend_flags(args)
        check_generation_config(args)
        check_listen_address(args)


def check_model(args) -> None:
    """--model and --tokenizer name something there (a file, a folder, a cached Hub id)."""
    from shared.model_source import resolve_model_path

    for flag, value in (("--model", args.model), ("--tokenizer", args.tokenizer)):
        if value is None and flag == "--tokenizer":
            continue
        try:
            resolve_model_path(value, args.revision, args.download_dir)
        except ValueError as exc:
            raise StartupError(f"{flag} {value}: {exc}") from None


def check_device(name: str) -> None:
    """--device names a device torch has here. Ahead of the model load: a CUDA device that is
    not there used to end, 20 s later, in torch's AssertionError."""
    if name in ("auto", "cpu"):
        return  # torch is not even imported for these
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise StartupError(f"--device {name}: not a device; use auto, cpu, cuda or "
                           "cuda:N") from None
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise StartupError(f"--device {name}: sluice runs on cpu or cuda; use auto, cpu, "
                           "cuda or cuda:N")
    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "no GPU is visible to it")
        raise StartupError(f"--device {name}: torch sees no CUDA device ({why}); use "
                           "--device cpu, or auto to take CUDA only where there is one")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise StartupError(f"--device {name}: torch sees {count} CUDA device(s), "
                           f"cuda:0 to cuda:{count - 1}")


def check_cpu_isa() -> None:
    """SLUICE_CPU_ISA names a target the kernels can be built for (engine.cpu_kernels); a
    misspelt one would otherwise end the engine in a ValueError traceback at its load."""
    from engine.cpu_kernels import target_isa

    try:
        target_isa()
    except ValueError as exc:
        raise StartupError(f"{exc}; unset it for this CPU's own") from None


def check_batch_invariant(args) -> None:
    """--batch-invariant on a CPU needs the compiled kernels, which SLUICE_CPU_KERNELS=0
    switches off (a failed build is only known once the engine tries it, and it says so)."""
    if not args.batch_invariant or args.device.startswith("cuda"):
        return
    from engine.cpu_kernels import enabled

    if not enabled() and (args.device == "cpu" or not _sees_cuda()):
        raise StartupError("--batch-invariant needs the engine's CPU kernels, which "
                           f"SLUICE_CPU_KERNELS={os.environ['SLUICE_CPU_KERNELS']} switches "
                           "off; unset it, or drop --batch-invariant")


def _sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_frontend_flags(args) -> None:
    """Frontend flags no request could be served with."""
    from frontend.input.rendering import RESERVED_TEMPLATE_KWARGS, load_chat_template

    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(args.default_chat_template_kwargs
                                                            or {}))
    if reserved:
        raise StartupError(f"--default-chat-template-kwargs may not set "
                           f"{', '.join(reserved)}: the server passes those itself")
    try:
        load_chat_template(args.chat_template)
    except FileNotFoundError:
        raise StartupError(f"--chat-template {args.chat_template}: no such file, and no Jinja "
                           "text either; give a template file or the template itself") from None
    except OSError as exc:
        raise StartupError(f"--chat-template {args.chat_template}: {exc.strerror}") from None
    media = args.allowed_local_media_path
    if media is not None and not os.path.isdir(media):
        raise StartupError(f"--allowed-local-media-path {media}: no such folder")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise StartupError("TLS needs both --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.path.isfile(path):
            raise StartupError(f"{flag} {path}: no such file")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise StartupError(f"--root-path {args.root_path!r} must start with / and not end "
                           "with one, e.g. /llm")


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
