"""`sluice postproc`: one postproc worker's flags, beside its code."""

from __future__ import annotations

import argparse

from shared.command_line import (
    DEFAULT_POSTPROC_ADDRESS,
    Command,
    add_model_arguments,
    model_names,
    tokenizer_path,
)
from shared.startup_checks import check_model


def add_postproc_command(postproc: argparse.ArgumentParser) -> None:
    add_model_arguments(postproc)
    postproc.add_argument("--engine-postproc-address", action="append", default=None,
                          help="an engine's --postproc-address; repeat for several, or give "
                               "dns+tcp://NAME:PORT for every address NAME resolves to "
                               f"(re-resolved) (default: {DEFAULT_POSTPROC_ADDRESS})")


def run_postproc_command(args) -> int:
    from postproc.worker import run_postproc
    from shared.tracing import start_tracing

    start_tracing("sluice-postproc", args.otlp_traces_endpoint)
    model = model_names(args)[0]
    run_postproc(tokenizer_path(args, model),
                 args.engine_postproc_address or [DEFAULT_POSTPROC_ADDRESS],
                 tokenizer_mode=args.tokenizer_mode, model=model)
    return 0


COMMAND = Command(
    "postproc", "run one postproc worker (detokenize, parse, format) for an engine",
    add_postproc_command, run_postproc_command, check=check_model)
