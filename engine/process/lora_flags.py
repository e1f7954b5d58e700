"""The engine's LoRA adapter flags (issue 36), vLLM's: they load and bound adapters;
--allow-runtime-lora-updating (frontend.http.flags) opens the frontend's load/unload routes.
`sluice serve` takes them too and forwards them (`lora_engine_argv`)."""

from __future__ import annotations

import argparse

import msgspec

from shared.command_line import int_at_least
from shared.protocol import LoraAdapterInfo


def _lora_module(text: str) -> LoraAdapterInfo:
    """--lora-modules: `name=path`, or vLLM's JSON {"name": .., "path": ..,
    "base_model_name": ..}."""
    if text.lstrip().startswith("{"):
        try:
            return msgspec.json.decode(text, type=LoraAdapterInfo)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise argparse.ArgumentTypeError(
                f'expected {{"name": ..., "path": ..., "base_model_name": ...}}: {exc}'
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError("expected name=path or a JSON object")
    return LoraAdapterInfo(name, path)


def add_lora_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) on the base model; requests pick "
                        "one by `model`")
    g.add_argument("--lora-modules", nargs="+", action="extend", type=_lora_module,
                   default=None, metavar="NAME=PATH",
                   help="adapters to load at start: name=path, or JSON "
                        '\'{"name": "a", "path": "/x", "base_model_name": "m"}\' '
                        "(needs --enable-lora)")
    g.add_argument("--max-loras", type=int_at_least(1), default=1,
                   help="distinct adapters in one step; requests for more wait in the queue "
                        "(default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int_at_least(1), default=16,
                   help="largest adapter rank taken (default: %(default)s)")
    g.add_argument("--max-cpu-loras", type=int_at_least(1), default=None,
                   help="most adapters loaded at once; a load past it is refused (default: "
                        "no limit)")


def lora_engine_config(args) -> dict:
    modules = list(getattr(args, "lora_modules", None) or [])
    return dict(enable_lora=bool(getattr(args, "enable_lora", False)), lora_modules=modules,
                max_loras=getattr(args, "max_loras", 1),
                max_lora_rank=getattr(args, "max_lora_rank", 16),
                max_cpu_loras=getattr(args, "max_cpu_loras", None) or 0)


def lora_engine_argv(args) -> list[str]:
    """The LoRA flags `serve` passes on to its engines."""
    if not args.enable_lora:
        return []
    argv = ["--enable-lora", "--max-loras", str(args.max_loras),
            "--max-lora-rank", str(args.max_lora_rank)]
    if args.max_cpu_loras is not None:
        argv += ["--max-cpu-loras", str(args.max_cpu_loras)]
    if args.lora_modules:
        argv += ["--lora-modules",
                 *(msgspec.json.encode(m).decode() for m in args.lora_modules)]
    return argv


def check_lora_flags(parser: argparse.ArgumentParser, args) -> None:
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    names = [m.name for m in getattr(args, "lora_modules", None) or []]
    if len(set(names)) != len(names):
        parser.error(f"--lora-modules names an adapter twice: {names}")
