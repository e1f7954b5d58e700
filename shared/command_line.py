"""What every `sluice` subcommand shares: the common flags (model, logging, `--config`, the
vLLM no-op and unsupported flags), the flag types, the `--config` YAML reader and vLLM's
spellings, and `Command`, the one shape a tier gives its subcommand in.

Each tier's own flags live beside its code (`engine/process/flags.py`, `frontend/http/flags.py`,
`postproc/flags.py`); the `sluice` console script (`sluice/cli.py`, outside every tier) lists
the commands, parses and dispatches. Nothing here imports a tier, so `shared` stays the
bottom of the dependency graph (tests/unit/test_import_layers.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec

from shared import json_flags
from shared import log_format as log_format_module
from shared.log_format import LOG_FORMATS
from shared.param_ranges import MAX_LOGPROBS, UNBOUNDED_LOGPROBS
from shared.runner_config import (
    GENERATE_TASKS,
    POOLING_TASKS,
    RUNNERS,
    parse_hf_overrides,
    parse_pooler_config,
)
from shared.tokenizer_modes import TOKENIZER_MODES
from shared.tracing_flags import add_tracing_arguments, check_tracing_flags


class Command(msgspec.Struct, frozen=True):
    """One subcommand: its flags (`add_arguments` on its own parser), its start-up checks
    (`sluice serve` runs those of every process it starts, before it starts any) and `run`,
    its exit code. `serves`: False for a client (bench): no log setup, no start-up checks."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[Any], int]
    check: Callable[[Any], None] = lambda args: None
    serves: bool = True
    # Checks across flags, run while parsing: errors through parser.error, as argparse's own.
    validate: Callable[[argparse.ArgumentParser, Any], None] = lambda parser, args: None


def new_parser(commands: list[Command]) -> argparse.ArgumentParser:
    """The `sluice` parser: one subparser per command, in the order given."""
    parser = _Parser(
        prog="sluice", description="OpenAI-compatible LLM serving: frontend, engine, postproc.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands:
        # Every subcommand's help states its defaults the same way.
        command.add_arguments(sub.add_parser(command.name, help=command.help,
                                             formatter_class=HelpFormatter))
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose errors under `--log-format json` are
    one JSON log line, as every other line the process writes."""

    json_errors = False

    def error(self, message: str):
        if not _Parser.json_errors:
            super().error(message)
        log_format_module.setup_logging("info", "json")
        logging.getLogger("sluice").error("%s: error: %s", self.prog, message)
        self.exit(2)


def _asks_json(argv: list[str]) -> bool:
    return any(a == "--log-format=json" or (a == "--log-format" and b == "json")
               for a, b in zip(argv, [*argv[1:], ""], strict=True))


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str],
                       commands: dict[str, Command]):
    """Parse a command line the way `sluice` does: vLLM spellings, --config, positional MODEL."""
    argv = normalize_argv(argv)
    _Parser.json_errors = _asks_json(argv)
    args, unknown = parser.parse_known_args(argv)
    # Errors found after parsing print the subcommand's usage, as its own parsing errors do.
    command = subcommand_parser(parser, args.command)
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    apply_model_tag(command, args)
    if commands[args.command].serves:
        check_log_format(args)
        args.compat_notes = vllm_compat_notes(command, args)
        check_tracing_flags(command, args)
        commands[args.command].validate(command, args)
    return args


DEFAULT_ENGINE_ADDRESS = "tcp://127.0.0.1:5555"


DEFAULT_POSTPROC_ADDRESS = "tcp://127.0.0.1:5556"


class HelpFormatter(argparse.HelpFormatter):
    """Every flag with a value by default states it, read from the flag's own default (a help
    text that words its default itself says "default" and uses %(default)s where it can)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, [], "", argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file, an HF folder, or a Hub id (org/name) in the local Hugging "
                        "Face cache (default: SmolLM2-135M-Instruct, bundled)")
    p.add_argument("--revision", default=None,
                   help="a Hub id's branch, tag or commit in the local cache (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache to find Hub ids in (default: $HF_HUB_CACHE, "
                        "else $HF_HOME/hub, else ~/.cache/huggingface/hub); nothing is "
                        "downloaded")
    p.add_argument("--served-model-name", nargs="+", action="extend", default=None,
                   metavar="NAME",
                   help="the names clients may send as 'model'; responses carry the first "
                        "(default: the Hub id, or derived from --model's file or folder)")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer, when not the model's: a .gguf file, an HF folder or a "
                        "Hub id in the local cache (default: --model's); with "
                        "--tokenizer-mode custom, the registered tokenizer's name")
    p.add_argument("--tokenizer-mode", default="auto", choices=TOKENIZER_MODES,
                   help="how the tokenizer loads, as vLLM's: auto (a Mistral-format folder, "
                        "tekken.json or tokenizer.model.v*, uses mistral-common, else hf), hf, "
                        "slow (as hf: transformers 5 has only fast tokenizers), mistral "
                        "(mistral-common, with its chat rendering), custom (--tokenizer names "
                        "a tokenizer registered in the sluice.tokenizers entry points)")
    p.add_argument("--max-logprobs", type=max_logprobs_value, default=MAX_LOGPROBS,
                   help="most logprobs / top_logprobs / prompt_logprobs a request may ask for; "
                        "-1: the whole vocabulary (default: %(default)s, as vLLM)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="how much the processes log")
    p.add_argument("--log-format", default="text", metavar="text|json",
                   help="text lines, or one JSON object a line (timestamp, level, logger, "
                        "message, role, engine_id, request_id, trace_id; docs/observability.md)"
                        ", uvicorn's lines too (default: %(default)s)")
    p.add_argument("--config", metavar="YAML",
                   help="flags from a YAML file, as vLLM's: `max_model_len: 2048`, `enforce_eager: "
                        "true`; flags on the command line win (underscores and dashes in flag "
                        "names are the same everywhere)")
    add_vllm_compat_arguments(p)
    _add_pooling_arguments(p)
    add_tracing_arguments(p)


# ---------------------------------------------------------------- pooling (embeddings)


def _add_pooling_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's runner choice and pooler settings (shared.runner_config), for the engine and
    the frontend alike: both read them from the same checkpoint."""
    g = p.add_argument_group("pooling models (embeddings)")
    g.add_argument("--runner", default="auto", choices=list(RUNNERS),
                   help="generate text, or pool prompts into embeddings (/v1/embeddings); "
                        "auto: pooling for a checkpoint whose architecture is a bare *Model "
                        "or a classifier, else generate")
    g.add_argument("--task", default=None, choices=[*GENERATE_TASKS, *POOLING_TASKS],
                   help="vLLM's older name for --runner: embed / embedding / pooling mean "
                        "--runner pooling, generate means --runner generate")
    g.add_argument("--pooler-config", type=_pooler_config, default=None, metavar="JSON",
                   help='how a pooling model pools: {"pooling_type": "LAST" | "MEAN" | '
                        '"CLS", "normalize": true} (default: the checkpoint\'s '
                        "sentence-transformers files, else the last token, normalized)")
    g.add_argument("--hf-overrides", type=_hf_overrides, default=None, metavar="JSON",
                   help="vLLM's, for a decoder served as a yes/no reranker (Qwen3-Reranker) "
                        "only: {\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                        "\"classifier_from_token\": [\"no\", \"yes\"], "
                        "\"is_original_qwen3_reranker\": true}; other keys are refused")
    g.add_argument("--max-embedding-inputs", type=int_at_least(1), default=2048,
                   help="most inputs one /v1/embeddings request may carry (default: "
                        "%(default)s, as OpenAI)")


def _checked_by(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type: the text itself, once `parse` takes it (its ValueError is the
    flag's error). The processes parse it again from their config."""
    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return check


_pooler_config = _checked_by(parse_pooler_config)
_hf_overrides = _checked_by(parse_hf_overrides)


def runner_of(args) -> str:
    """--runner, or what --task says when --runner is left at auto."""
    task = getattr(args, "task", None)
    runner = getattr(args, "runner", "auto")
    if runner == "auto" and task is not None and task != "auto":
        return "pooling" if task in POOLING_TASKS else "generate"
    return runner


# vLLM flags that change nothing here: accepted, with one log line saying so.
# flag -> why it changes nothing.
VLLM_NOOP_FLAGS = {
    "--trust-remote-code": "sluice runs its own model code; no code from the model is loaded",
    "--enable-auto-tool-choice": "tool_choice auto works whenever --tool-call-parser is set",
    "--disable-log-stats": "the engine logs no periodic stats to disable",
    "--disable-log-requests": "requests are logged one by one only with --enable-log-requests",
    "--disable-frontend-multiprocessing": "the frontend is always its own process",
    "--disable-fastapi-docs": "there are no /docs pages to disable",
    "--enable-prefix-caching": "prefix caching is always on",
    "--enable-chunked-prefill": "chunked prefill is always on",
    "--enable-request-id-headers": "X-Request-Id is always read and echoed",
}


# vLLM flags for features sluice does not have: flag -> (type, the value that asks for
# nothing, what is missing). Any other value stops the process at start, naming the flag.
VLLM_UNSUPPORTED_FLAGS: dict[str, tuple[type, object, str]] = {
    "--pipeline-parallel-size": (int, 1, "pipeline parallelism (one engine runs on one "
                                 "device)"),
    "--cpu-offload-gb": (float, 0.0, "offloading weights to CPU memory"),
    "--no-enable-prefix-caching": (bool, False, "way to turn prefix caching off (it is always "
                                   "on; a request's cache_salt keeps tenants apart)"),
}


_SHORT_FLAGS = {"--pipeline-parallel-size": "-pp"}

# vLLM's --quantization values for the checkpoints sluice runs in place: the method is read
# from config.json's quantization_config; naming one only checks that it is the checkpoint's
# (engine.layers.quant_config). The marlin names are vLLM's CUDA kernels for the same files.
QUANTIZATION_METHODS = ("gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors", "gguf",
                        "mxfp4")


def _quantization(text: str) -> str:
    if text not in QUANTIZATION_METHODS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: sluice runs {', '.join(QUANTIZATION_METHODS)} (4-bit; the "
            "checkpoint's quantization_config says which)")
    return text


def add_vllm_compat_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM flags that change nothing here (accepted and logged) or "
                             "ask for what sluice lacks (the process stops at start)")
    for flag, why in VLLM_NOOP_FLAGS.items():
        g.add_argument(flag, action="store_true", help=f"no-op: {why}")
    g.add_argument("--quantization", "-q", type=_quantization, default=None,
                   help="the checkpoint's quantization method, as vLLM's override; refused "
                        "unless it is the one config.json's quantization_config names "
                        "(default: that one, or none)")
    for flag, (kind, default, missing) in VLLM_UNSUPPORTED_FLAGS.items():
        names = [flag, *([_SHORT_FLAGS[flag]] if flag in _SHORT_FLAGS else [])]
        if kind is bool:
            g.add_argument(*names, action="store_true", help=f"not supported: {missing}")
        else:
            g.add_argument(*names, type=kind, default=default,
                           help=f"only %(default)r (not supported: {missing})")


def vllm_compat_notes(parser: argparse.ArgumentParser, args) -> list[str]:
    """Stop on a vLLM flag asking for a missing feature; the log lines for no-op flags."""
    for flag, (_, default, missing) in VLLM_UNSUPPORTED_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), default)
        if value != default:
            parser.error(f"{flag} {value}: sluice has no {missing}")
    return [f"{flag} changes nothing here: {why}" for flag, why in VLLM_NOOP_FLAGS.items()
            if getattr(args, flag[2:].replace("-", "_"), False)]


def add_model_tag(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's `vllm serve MODEL`: the same as --model")


def max_logprobs_value(text: str) -> int:
    value = int_at_least(-1)(text)
    return UNBOUNDED_LOGPROBS if value == -1 else value


def seed_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 2**63)")
    return value


def int_at_least(low: int):
    """An argparse type: an integer no smaller than `low` (a bound of 0 would refuse
    everything, a negative one makes no sense)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum, {low}")
        return value
    return parse


def int_in(low: int, high: int):
    """An argparse type: an integer in [low, high]."""
    at_least = int_at_least(low)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{value} is above the maximum, {high}")
        return value
    return parse


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (a size, or a timeout that can pass)."""
    value = number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not above 0")
    return value


def share(text: str) -> float:
    """An argparse type: a share in (0, 1]."""
    value = number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def seconds(text: str) -> float:
    """An argparse type: a finite, non-negative number of seconds."""
    value = number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not a finite number of seconds >= 0")
    return value


def json_object(text: str) -> dict:
    try:
        return json_flags.json_object(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's spellings of a command line: `--max_model_len` as `--max-model-len`, and
    `--config FILE` (a YAML mapping of flag names to values, as vLLM's) expanded in place,
    before the flags given on the line, so those win."""
    out: list[str] = []
    for arg in argv:
        if arg.startswith("--") and arg != "--":
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("_", "-") + eq + value
        out.append(arg)
    for i, arg in enumerate(out):
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if i + 1 >= len(out):
                    raise SystemExit("sluice: --config needs a YAML file")
                path, rest = out[i + 1], out[i + 2:]
            else:
                path, rest = arg.split("=", 1)[1], out[i + 1:]
            head = out[:i]
            # The config's flags go right after the subcommand, so the line's own win.
            cut = 1 if head and not head[0].startswith("-") else 0
            return normalize_argv([*head[:cut], *config_file_argv(path), *head[cut:], *rest])
    return out


def config_file_argv(path: str) -> list[str]:
    """The flags a `--config` YAML file stands for: `key: value` is `--key value`, `key: true`
    is `--key`, `key: false` is left out, a list gives `--key=item` for each item (the flags
    that take several values all add them up)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise SystemExit(f"sluice: --config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SystemExit(f"sluice: --config {path}: not YAML: {e}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise SystemExit(f"sluice: --config {path}: must map flag names to values")
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            raise SystemExit(f"sluice: --config {path}: a config file cannot name another")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):  # one flag per item: a MODEL after it stays positional
            for item in value:
                argv.append(f"{flag}={item}")
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def apply_model_tag(parser: argparse.ArgumentParser, args) -> None:
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        parser.error(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = tag


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def model_names(args) -> tuple[str, list[str]]:
    """The model's path and the names it is served under (the first is the one responses
    carry)."""
    from shared.model_source import is_hub_id, resolve_model_path, served_model_name

    path = resolve_model_path(args.model, args.revision, args.download_dir)
    if args.served_model_name:
        return path, list(dict.fromkeys(args.served_model_name))
    from_hub = (args.model is not None and is_hub_id(args.model)
                and not os.path.exists(os.path.expanduser(args.model)))
    # A Hub id is its own name, as in vLLM; a path's name comes from its file or folder.
    return path, [args.model if from_hub else served_model_name(path)]


def tokenizer_path(args, model_path: str) -> str:
    """--tokenizer resolved like --model (the same cache and revision), else the model."""
    from shared.model_source import resolve_model_path

    if getattr(args, "tokenizer", None) is None:
        return model_path
    if getattr(args, "tokenizer_mode", "auto") == "custom":
        return args.tokenizer  # a registered name, not a path
    return resolve_model_path(args.tokenizer, args.revision, args.download_dir)


def check_log_format(args) -> None:
    """--log-format's refusal: one line, as every start-up mistake (not argparse's usage)."""
    if args.log_format not in LOG_FORMATS:
        raise SystemExit(f"sluice: --log-format {args.log_format}: expected one of "
                         f"{', '.join(LOG_FORMATS)}")


def setup_logging(level: str, log_format: str = "text", role: str | None = None) -> None:
    log_format_module.setup_logging(level, log_format, role)
