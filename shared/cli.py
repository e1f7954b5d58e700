"""`sluice` command line: serve (all on one machine), engine, frontend, postproc, bench.

Each process kind imports its own package only when its subcommand runs, so `shared` stays
the bottom of the dependency graph at import time.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import msgspec

from shared.config import OPEN_PATHS, EngineConfig, FrontendConfig, HttpSettings
from shared.param_ranges import MAX_LOGPROBS, UNBOUNDED_LOGPROBS
from shared.prometheus_dir import prepare_prometheus_dir
from shared.speculative import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
    SpeculativeConfigError,
    parse_speculative_config,
)
from shared.speculative import FLAG as SPEC_FLAG
from shared.startup_checks import check_startup
from shared.transport import free_tcp_port, new_ipc_address, remove_ipc_file

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


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
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
                        "Hub id in the local cache (default: --model's)")
    p.add_argument("--max-logprobs", type=_max_logprobs, default=MAX_LOGPROBS,
                   help="most logprobs / top_logprobs / prompt_logprobs a request may ask for; "
                        "-1: the whole vocabulary (default: %(default)s, as vLLM)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="how much the processes log")
    p.add_argument("--config", metavar="YAML",
                   help="flags from a YAML file, as vLLM's: `max_model_len: 2048`, `enforce_eager: "
                        "true`; flags on the command line win (underscores and dashes in flag "
                        "names are the same everywhere)")
    _add_vllm_compat_arguments(p)


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
    "--disable-uvicorn-access-log": "the HTTP server keeps no access log",
}

# vLLM flags for features sluice does not have: flag -> (type, the value that asks for
# nothing, what is missing). Any other value stops the process at start, naming the flag.
VLLM_UNSUPPORTED_FLAGS: dict[str, tuple[type, object, str]] = {
    "--pipeline-parallel-size": (int, 1, "pipeline parallelism (one engine runs on one "
                                 "device)"),
    "--quantization": (str, None, "quantization methods (awq, gptq, fp8, ...): weights load "
                       "as GGUF or safetensors and compute in --dtype"),
    "--enable-lora": (bool, False, "LoRA adapters"),
    "--kv-cache-dtype": (str, "auto", "KV cache dtype other than --dtype's"),
    "--cpu-offload-gb": (float, 0.0, "offloading weights to CPU memory"),
    "--no-enable-prefix-caching": (bool, False, "way to turn prefix caching off (it is always "
                                   "on; a request's cache_salt keeps tenants apart)"),
}
_SHORT_FLAGS = {"--pipeline-parallel-size": "-pp", "--quantization": "-q"}


def _add_vllm_compat_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM flags that change nothing here (accepted and logged) or "
                             "ask for what sluice lacks (the process stops at start)")
    for flag, why in VLLM_NOOP_FLAGS.items():
        g.add_argument(flag, action="store_true", help=f"no-op: {why}")
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


def _mm_limit(value: str) -> int:
    """--limit-mm-per-prompt: vLLM's JSON ({"image": N}); only images are taken here."""
    try:
        limits = json.loads(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected JSON such as '{\"image\": 4}'") from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise argparse.ArgumentTypeError("only an 'image' limit is supported")
    n = limits.get("image", 8)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 64:
        raise argparse.ArgumentTypeError("the image limit must be an integer in [0, 64]")
    return n


def _add_model_tag(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's `vllm serve MODEL`: the same as --model")


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache; auto = bfloat16 on CUDA and on CPUs "
                        "with native bf16 matmul (AMX, AVX512-BF16), else float32")
    g.add_argument("--device", default="auto",
                   help="torch device: auto (cuda when torch sees a GPU, else cpu), cpu, "
                        "cuda or cuda:N (default: %(default)s)")
    g.add_argument("--attention-backend", default="auto", type=_attention_backend,
                   help="auto, torch or flashinfer (vLLM's TORCH_SDPA and FLASHINFER too); "
                        "auto = flashinfer on CUDA when installed and the dtype is 16-bit, "
                        "else torch (the engine logs which and why)")
    g.add_argument("--page-size", "--block-size", type=_int_at_least(1), default=16,
                   help="tokens per KV cache page (--block-size: vLLM's name)")
    g.add_argument("--kv-cache-memory-gb", type=_positive_number, default=1.0,
                   help="memory for the KV cache on CPU, in GiB (default: %(default)s)")
    g.add_argument("--kv-cache-memory-bytes", type=_int_at_least(1), default=None,
                   help="the same in bytes (vLLM's name); wins over --kv-cache-memory-gb")
    g.add_argument("--gpu-memory-utilization", type=_share, default=0.9,
                   help="CUDA: share of the GPU's memory for weights, activations and the KV "
                        "cache, which gets what the others leave (default: %(default)s)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    g.add_argument("--batch-invariant", action="store_true",
                   default=os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1",
                   help="a request's tokens do not depend on what else shares its steps: "
                        "greedy and seeded answers repeat exactly under any load, chunking "
                        "or prefix-cache hit (kernels with one fixed sum order per row; CPU "
                        "float32/bfloat16; see docs/batch-invariance.md for the cost; "
                        "default: on when VLLM_BATCH_INVARIANT=1, as vLLM)")
    g.add_argument("--num-kv-pages", "--num-gpu-blocks-override", type=_int_at_least(1),
                   default=None,
                   help="exact number of KV pages (overrides --kv-cache-memory-gb; "
                        "--num-gpu-blocks-override: vLLM's name)")
    g.add_argument("--max-model-len", type=_int_at_least(1), default=None,
                   help="longest prompt + answer in tokens (default: the model's context)")
    g.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=512,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                        "(default: %(default)s)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="queue order: arrival, or the request's priority (lower first), then "
                        "arrival")
    g.add_argument("--max-num-seqs", type=_int_at_least(1), default=128,
                   help="most sequences in the running batch (default: %(default)s)")
    g.add_argument("--long-prefill-token-threshold", type=_int_at_least(0), default=None,
                   help="while other requests want to run, a prompt with more tokens left "
                        "than this is prefilled at most this many tokens a step, one such "
                        "prompt at a time (default: a quarter of --max-num-batched-tokens; "
                        "0: no cap)")
    g.add_argument("--frontend-timeout", type=_seconds, default=10.0,
                   help="seconds without a heartbeat after which the engine aborts a "
                        "frontend's requests (default: %(default)s; 0: never)")
    g.add_argument("--threads", type=_int_at_least(1), default=None,
                   help="torch CPU threads (default: torch's choice, one per core; under "
                        "serve --data-parallel-size N, each engine's share of the CPUs)")
    g.add_argument("--seed", type=_seed, default=None,
                   help="seed the engine's random generators at start, so requests without "
                        "a seed of their own repeat from run to run (default: not seeded)")
    g.add_argument("--speculative-config", type=_speculative_config, default=None,
                   metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON; only model-free prompt lookup: '
                        '{"method": "ngram", "num_speculative_tokens": K, '
                        '"prompt_lookup_max": N, "prompt_lookup_min": M} (optional: '
                        f'"disable_by_batch_size", default {DEFAULT_DISABLE_BY_BATCH_SIZE}: '
                        "no drafts with more sequences than that in the engine). "
                        "Default: off")
    _add_tensor_parallel_arguments(g)


def _add_tensor_parallel_arguments(g) -> None:
    """Tensor parallelism (engine.parallel): one engine's model over several ranks, on
    this machine or over several, meeting through torch.distributed's TCP rendezvous."""
    g.add_argument("--tensor-parallel-size", "-tp", type=_int_at_least(1), default=1,
                   help="ranks one engine's model is split over: one process per GPU on "
                        "CUDA (NCCL), each with an equal share of the CPUs otherwise (gloo); "
                        "rank 0 is the engine the frontends see (default: %(default)s)")
    g.add_argument("--nnodes", type=_int_at_least(1), default=1,
                   help="machines the ranks of --tensor-parallel-size are spread over, an "
                        "equal number on each (default: %(default)s)")
    g.add_argument("--node-rank", type=_int_at_least(0), default=0,
                   help="this machine's index among --nnodes; node 0 runs rank 0, the "
                        "engine; the others run `sluice engine` with the same flags and only "
                        "follow it (default: %(default)s)")
    g.add_argument("--master-addr", default=None,
                   help="the host of node 0, where the ranks meet (needed with --nnodes > "
                        "1; default: 127.0.0.1). torchrun's MASTER_ADDR, RANK, WORLD_SIZE "
                        "environment is taken instead when set")
    g.add_argument("--master-port", type=_int_in(1, 65535), default=None,
                   help="the rendezvous port on --master-addr (default: a free port on one "
                        "machine, 29500 over several)")


# vLLM's attention backend names that mean one of ours.
_VLLM_ATTENTION_BACKENDS = {"TORCH_SDPA": "torch", "FLASHINFER": "flashinfer"}


def _attention_backend(text: str) -> str:
    name = _VLLM_ATTENTION_BACKENDS.get(text.upper(), text.lower())
    if name not in ("auto", "torch", "flashinfer"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a backend here: auto, torch (vLLM's TORCH_SDPA) or flashinfer")
    return name


def _max_logprobs(text: str) -> int:
    value = _int_at_least(-1)(text)
    return UNBOUNDED_LOGPROBS if value == -1 else value


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except SpeculativeConfigError as exc:
        # argparse names the flag already.
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{SPEC_FLAG}: ")) from None


def _role(text: str) -> str:
    """--response-role: a role name; empty or blank would give messages no role at all."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the role may not be empty")
    return text


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} is outside [0, 2**63)")
    return value


def _int_at_least(low: int):
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


def _int_in(low: int, high: int):
    """An argparse type: an integer in [low, high]."""
    at_least = _int_at_least(low)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"{value} is above the maximum, {high}")
        return value
    return parse


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def _positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (a size, or a timeout that can pass)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not above 0")
    return value


def _share(text: str) -> float:
    """An argparse type: a share in (0, 1]."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite, non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a finite number of seconds >= 0")
    return value


def _add_frontend_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("frontend")
    g.add_argument("--host", default=os.environ.get("SLUICE_HOST", "127.0.0.1"),
                   help="address the HTTP server binds (default: $SLUICE_HOST, else "
                        "127.0.0.1; the images set SLUICE_HOST=0.0.0.0)")
    g.add_argument("--port", type=_int_in(0, 65535), default=8000,
                   help="port the HTTP server listens on")
    g.add_argument("--tokenizer-threads", type=_int_at_least(1), default=4,
                   help="threads that render and tokenize requests (default: %(default)s)")
    g.add_argument("--render-timeout", type=_positive_number, default=30.0,
                   help="seconds a chat template may take to render before its request fails "
                        "with a 400 and its thread is replaced; a request that waits this "
                        "long for a free render thread gets a 503 instead (default: %(default)s)")
    g.add_argument("--chat-template", default=None,
                   help="chat template for chat requests: a file path or the Jinja text itself "
                        "(default: the tokenizer's)")
    g.add_argument("--chat-template-content-format", default="auto",
                   choices=["auto", "string", "openai"],
                   help="how chat templates get message content: string (parts joined), "
                        "openai (a list of {type, text} parts), or auto: openai when the "
                        "template loops over a message's content (default: %(default)s)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let image parts name local files (file:// URLs) inside DIR; off by "
                        "default, as in vLLM: any file the server can read would be readable")
    g.add_argument("--limit-mm-per-prompt", type=_mm_limit, default=8, metavar="JSON",
                   help="most images one prompt may carry, as vLLM: '{\"image\": N}' "
                        "(default: %(default)s)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (a request's template runs "
                        "on this server's CPU; off by default)")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split the model's thinking from its answer (default: off)")
    g.add_argument("--reasoning-field", default="reasoning_content",
                   choices=["reasoning_content", "reasoning"],
                   help="the response field that carries thinking (default: %(default)s, "
                        "as DeepSeek, SGLang and llama.cpp; vLLM now says reasoning)")
    g.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"],
                   help="turn the model's tool-call syntax into tool_calls (default: off; "
                        "tools are then only accepted with tool_choice none)")
    g.add_argument("--max-stored-responses", type=_int_at_least(0), default=1000,
                   help="/v1/responses kept in this frontend's memory for GET and "
                        "previous_response_id, least recently used dropped first; 0 stores "
                        "none (default: %(default)s)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="sampling defaults for fields a request leaves out: auto, the model's "
                        "generation_config.json (beside a .gguf file too); vllm, none (the "
                        "OpenAI defaults); a FOLDER, its generation_config.json "
                        "(default: %(default)s)")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="JSON laid over those defaults, e.g. '{\"temperature\": 0.5}' "
                        "(fields: temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens)")
    g.add_argument("--response-role", default="assistant", type=_role,
                   help="the role of chat completion messages when the request's "
                        "add_generation_prompt is true (default: %(default)s)")
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                   metavar="JSON",
                   help="chat_template_kwargs every chat request gets, under its own, e.g. "
                        "'{\"enable_thinking\": false}' (default: none)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per request as it is sent to the engine: its id, "
                        "prompt length and sampling parameters")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="with --enable-log-requests: also log each finished request's output "
                        "text, token count and finish reason")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:N' instead of their text, for every "
                        "request (a request's return_tokens_as_token_ids does it for itself)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="chat and completion usage carry prompt_tokens_details.cached_tokens: "
                        "the prompt tokens found in the prefix cache")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed answer ends with a usage chunk, as if its "
                        "stream_options.include_usage were true")
    _add_http_arguments(p)
    _add_limit_arguments(p)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _add_http_arguments(p: argparse.ArgumentParser) -> None:
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


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("frontend limits and security")
    g.add_argument("--api-key", action="append", default=[], dest="api_keys", metavar="KEY",
                   help="require this key (Authorization: Bearer KEY, or x-api-key: KEY) on "
                        f"every route but {', '.join(OPEN_PATHS)}; repeat for several "
                        "keys; SLUICE_API_KEY adds comma-separated keys (default: none)")
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
    g.add_argument("--max-request-body-bytes", type=_int_at_least(1), default=32 * 2**20,
                   help="larger request bodies get a 413 (default: 32 MiB)")
    g.add_argument("--max-queued-requests", "--max-num-queued-reqs", type=_int_at_least(1),
                   default=None,
                   help="requests this frontend has accepted that have not started generating; "
                        "beyond it new ones get a 503 with Retry-After (default: no cap; "
                        "--max-num-queued-reqs: vLLM's name, counted per frontend here)")
    g.add_argument("--request-timeout", type=_positive_number, default=None,
                   help="seconds a request may take from arrival to its last token; then it "
                        "ends with a 504 error and is aborted in the engine (default: none)")
    g.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                   help="on SIGTERM or SIGINT, seconds in-flight requests may still run while "
                        "new ones get a 503; then the rest end with an error "
                        "(default: %(default)s)")
    _add_bound_arguments(p)


# Bounds per request (frontend.input_bounds): flag -> (FrontendConfig field, default, help).
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
        g.add_argument(flag, type=_int_at_least(1), default=default, dest=dest,
                       help=f"{what} (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice", description="OpenAI-compatible LLM serving: frontend, engine, postproc.",
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # Every subcommand's help states its defaults the same way.
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=HelpFormatter)

    serve = sub.add_parser(
        "serve", help="engine + frontend (+ postproc workers) on this machine (over ipc)")
    _add_model_tag(serve)
    _add_model_arguments(serve)
    _add_engine_arguments(serve)
    _add_frontend_arguments(serve)
    serve.add_argument("--postproc-workers", type=_int_at_least(0), default=0,
                       help="postproc worker processes to start (default: %(default)s, the "
                            "frontend post-processes on its receiver thread)")
    serve.add_argument("--data-parallel-size", "-dp", type=_int_at_least(1), default=1,
                       help="engines to start, each on its own GPU (CUDA) or its own share "
                            "of the CPUs, all behind the frontend (default: %(default)s)")
    _add_routing_argument(serve)

    engine = sub.add_parser("engine", help="run the engine alone")
    _add_model_tag(engine)
    _add_model_arguments(engine)
    _add_engine_arguments(engine)
    engine.add_argument("--engine-address", default=DEFAULT_ENGINE_ADDRESS,
                        help="where to bind for frontends (default: %(default)s)")
    engine.add_argument("--engine-id", default=None,
                        help="this engine's name in stats, metrics and logs (default: the "
                             "hostname plus --engine-address)")
    engine.add_argument("--postproc-address", default=None,
                        help="where to bind for postproc workers, e.g. "
                             f"{DEFAULT_POSTPROC_ADDRESS} (default: no fleet; frontends "
                             "post-process their own requests)")
    engine.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                        help="on SIGTERM, seconds the engine runs the requests it holds while "
                             "frontends send it nothing new; then it exits and frontends move "
                             "what is left to other engines (default: 30; a second SIGTERM: "
                             "at once)")
    engine.add_argument("--metrics-port", type=_int_at_least(1), default=None,
                        help="serve the engine's Prometheus /metrics on this port (its series "
                             "once per engine, whatever the number of frontends; default: "
                             "not served)")
    engine.add_argument("--metrics-host", default=os.environ.get("SLUICE_HOST", "127.0.0.1"),
                        help="the address --metrics-port binds (default: $SLUICE_HOST, "
                             "else 127.0.0.1)")

    frontend = sub.add_parser("frontend", help="run one HTTP frontend against an engine")
    _add_model_arguments(frontend)
    _add_frontend_arguments(frontend)
    frontend.add_argument("--engine-address", action="append", default=None,
                          help="an engine to use; repeat for several, or give "
                               "dns+tcp://NAME:PORT for every address NAME resolves to "
                               "(re-resolved, so engines may join and leave; a Kubernetes "
                               f"headless Service) (default: {DEFAULT_ENGINE_ADDRESS})")
    _add_routing_argument(frontend)
    frontend.add_argument("--export-engine-metrics", action="store_true",
                          help="also export the engine's series (from its heartbeat) on this "
                               "frontend's /metrics: right for one frontend per engine (serve "
                               "sets it); with several, scrape the engine's --metrics-port, "
                               "or sums count the engine once per frontend")
    frontend.add_argument("--result-address", default=None,
                          help="where this frontend receives outputs; must be reachable from "
                               "the engine (default: ipc next to an ipc engine, otherwise "
                               "tcp://127.0.0.1 on a free port)")

    postproc = sub.add_parser(
        "postproc", help="run one postproc worker (detokenize, parse, format) for an engine")
    _add_model_arguments(postproc)
    postproc.add_argument("--engine-postproc-address", action="append", default=None,
                          help="an engine's --postproc-address; repeat for several, or give "
                               "dns+tcp://NAME:PORT for every address NAME resolves to "
                               f"(re-resolved) (default: {DEFAULT_POSTPROC_ADDRESS})")

    bench = sub.add_parser("bench", help="load-test any OpenAI-compatible server")
    from shared.bench import add_bench_arguments

    add_bench_arguments(bench)
    return parser


def _add_routing_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", choices=["prefix", "least-loaded", "round-robin"],
                   default="prefix",
                   help="how a frontend picks an engine per request: prefix (the same first "
                        "prompt pages and cache_salt prefer the same engine, bounded by "
                        "load), least-loaded or round-robin (default: %(default)s)")
    # Migration (frontend.engine_client): what a frontend does when an engine is lost.
    p.add_argument("--migration-limit", type=_int_at_least(0), default=3,
                   help="how many times one streaming request may move to another engine "
                        "when its engine dies, freezes or drains: it goes on there with the "
                        "tokens generated so far; past the limit it ends with an error "
                        "(default: %(default)s; 0: never move a started request; "
                        "vLLM/Dynamo's name)")
    p.add_argument("--engine-timeout", type=_seconds, default=30.0,
                   help="seconds requests wait for an engine when none answers (a frozen "
                        "or restarting one): in-flight requests go on when one is back, new "
                        "ones wait instead of a 503; then they end with an error "
                        "(default: %(default)s)")


def resolve_device(name: str) -> str:
    """`auto`: cuda when torch sees a GPU, else cpu; anything else as given."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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


def _apply_model_tag(parser: argparse.ArgumentParser, args) -> None:
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        parser.error(f"the model is given twice: {tag!r} and --model {args.model!r}")
    args.model = tag


def parse_args(argv: list[str]):
    """Parse a command line the way `main` does: vLLM spellings, --config, positional MODEL."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(normalize_argv(argv))
    # Errors found after parsing print the subcommand's usage, as its own parsing errors do.
    command = _subcommand_parser(parser, args.command)
    if unknown:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    _apply_model_tag(command, args)
    if args.command != "bench":
        args.compat_notes = vllm_compat_notes(command, args)
    return args


def _subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def _model_names(args) -> tuple[str, list[str]]:
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


def _tokenizer_path(args, model_path: str) -> str:
    """--tokenizer resolved like --model (the same cache and revision), else the model."""
    from shared.model_source import resolve_model_path

    if getattr(args, "tokenizer", None) is None:
        return model_path
    return resolve_model_path(args.tokenizer, args.revision, args.download_dir)


def _kv_cache_memory_gb(args) -> float:
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes / 2**30
    return args.kv_cache_memory_gb


def engine_config(args, address: str, postproc_address: str | None = None) -> EngineConfig:
    path, names = _model_names(args)
    return EngineConfig(
        model=path, tokenizer=_tokenizer_path(args, path), served_model_name=names[0],
        request_address=address, dtype=args.dtype,
        device=resolve_device(args.device), attention_backend=args.attention_backend,
        page_size=args.page_size,
        kv_cache_memory_gb=_kv_cache_memory_gb(args), num_pages=args.num_kv_pages,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, threads=args.threads,
        scheduling_policy=args.scheduling_policy, postproc_address=postproc_address,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        frontend_timeout_s=args.frontend_timeout, seed=args.seed,
        shutdown_timeout_s=getattr(args, "shutdown_timeout", 30.0),
        max_logprobs=args.max_logprobs, metrics_port=getattr(args, "metrics_port", None),
        speculative=args.speculative_config,
        engine_id=getattr(args, "engine_id", None) or f"{socket.gethostname()}@{address}",
        metrics_host=getattr(args, "metrics_host", "127.0.0.1"),
        tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
    )


def frontend_config(args, engine_address: str | list[str] | None,
                    result_address: str | None) -> FrontendConfig:
    path, names = _model_names(args)
    addresses = ([engine_address] if isinstance(engine_address, str) else
                 list(engine_address or [DEFAULT_ENGINE_ADDRESS]))
    engine_address = addresses[0]
    if result_address is None and not all(a.startswith("ipc://") for a in addresses):
        result_address = f"tcp://127.0.0.1:{free_tcp_port()}"
    return FrontendConfig(
        model=path, tokenizer=_tokenizer_path(args, path), served_model_name=names[0],
        served_model_aliases=names[1:], engine_address=engine_address, host=args.host,
        engine_addresses=addresses, routing=getattr(args, "routing", "prefix"),
        port=args.port, result_address=result_address,
        tokenizer_threads=args.tokenizer_threads, log_level=args.log_level,
        render_timeout_s=args.render_timeout, chat_template=args.chat_template,
        chat_template_content_format=args.chat_template_content_format,
        trust_request_chat_template=args.trust_request_chat_template,
        allowed_local_media_path=args.allowed_local_media_path,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        reasoning_field=args.reasoning_field, max_stored_responses=args.max_stored_responses,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        response_role=args.response_role,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        log_requests=args.enable_log_requests, log_outputs=args.enable_log_outputs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        force_include_usage=args.enable_force_include_usage,
        max_logprobs=args.max_logprobs,
        export_engine_metrics=getattr(args, "export_engine_metrics", False),
        engine_timeout_s=getattr(args, "engine_timeout", 30.0),
        migration_limit=getattr(args, "migration_limit", 3),
        http=HttpSettings(root_path=args.root_path, uds=args.uds,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                          log_level=args.uvicorn_log_level or args.log_level),
        **_limit_config(args),
    )


def _listed(values: list[str] | None, default: list[str]) -> list[str]:
    """Flag values, where one may also be a JSON list (vLLM's `--allowed-origins '["*"]'`)."""
    if not values:
        return default
    out: list[str] = []
    for value in values:
        out.extend(json.loads(value) if value.startswith("[") else [value])
    return out


def _api_keys(args) -> list[str]:
    from_env = [k.strip() for k in os.environ.get("SLUICE_API_KEY", "").split(",")]
    return list(dict.fromkeys(k for k in [*args.api_keys, *from_env] if k))


def _limit_config(args) -> dict:
    return dict(
        api_keys=_api_keys(args), allowed_origins=_listed(args.allowed_origins, []),
        allowed_methods=_listed(args.allowed_methods, ["*"]),
        allowed_headers=_listed(args.allowed_headers, ["*"]),
        allow_credentials=args.allow_credentials,
        max_request_body_bytes=args.max_request_body_bytes,
        max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        **{dest: getattr(args, dest) for dest, _, _ in _BOUNDS.values()},
    )


def _limit_argv(args) -> list[str]:
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
    return argv


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _serve(args) -> int:
    """Start engine and frontend as two processes over ipc and watch them."""
    address = new_ipc_address("engine")
    common = ["--log-level", args.log_level]
    if args.model:
        common += ["--model", args.model]
    if args.served_model_name:
        common += ["--served-model-name", *args.served_model_name]
    for flag, value in (("--revision", args.revision), ("--download-dir", args.download_dir),
                        ("--tokenizer", args.tokenizer)):
        if value is not None:
            common += [flag, value]
    engine_argv = [
        "engine", *common, "--engine-address", address, "--dtype", args.dtype,
        "--device", args.device, "--page-size", str(args.page_size),
        "--kv-cache-memory-gb", str(_kv_cache_memory_gb(args)),
        "--attention-backend", args.attention_backend,
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-num-seqs", str(args.max_num_seqs),
        "--scheduling-policy", args.scheduling_policy,
        "--frontend-timeout", str(args.frontend_timeout),
        "--max-logprobs", str(args.max_logprobs),
        "--tensor-parallel-size", str(args.tensor_parallel_size), "--nnodes", str(args.nnodes),
        "--node-rank", str(args.node_rank),
    ]
    for flag, value in (("--num-kv-pages", args.num_kv_pages),
                        ("--master-addr", args.master_addr), ("--master-port", args.master_port),
                        ("--max-model-len", args.max_model_len), ("--threads", args.threads),
                        ("--long-prefill-token-threshold", args.long_prefill_token_threshold),
                        ("--seed", args.seed)):
        if value is not None:
            engine_argv += [flag, str(value)]
    if args.enforce_eager:
        engine_argv.append("--enforce-eager")
    if args.batch_invariant:
        engine_argv.append("--batch-invariant")
    if args.speculative_config is not None:
        engine_argv += ["--speculative-config",
                        msgspec.json.encode(args.speculative_config).decode()]
    # serve names every ipc socket its processes bind, so it can remove their files at exit
    # (a process that is killed leaves its socket file behind).
    result_address = new_ipc_address("frontend")
    frontend_argv = [
        "frontend", *common, "--engine-address", address, "--result-address", result_address,
        "--host", args.host,
        "--port", str(args.port), "--tokenizer-threads", str(args.tokenizer_threads),
        "--render-timeout", str(args.render_timeout),
        "--max-logprobs", str(args.max_logprobs), "--response-role", args.response_role,
        "--root-path", args.root_path, "--ssl-cert-reqs", str(args.ssl_cert_reqs),
        # One frontend on one port: its /metrics is the engine's too, as `vllm serve`'s.
        "--export-engine-metrics",
    ]
    for flag, value in (("--uds", args.uds), ("--ssl-keyfile", args.ssl_keyfile),
                        ("--ssl-certfile", args.ssl_certfile),
                        ("--ssl-ca-certs", args.ssl_ca_certs),
                        ("--uvicorn-log-level", args.uvicorn_log_level)):
        if value is not None:
            frontend_argv += [flag, value]
    if args.default_chat_template_kwargs:
        frontend_argv += ["--default-chat-template-kwargs",
                          json.dumps(args.default_chat_template_kwargs)]
    for flag, on in (("--enable-log-requests", args.enable_log_requests),
                     ("--enable-log-outputs", args.enable_log_outputs),
                     ("--return-tokens-as-token-ids", args.return_tokens_as_token_ids),
                     ("--enable-prompt-tokens-details", args.enable_prompt_tokens_details),
                     ("--enable-force-include-usage", args.enable_force_include_usage)):
        if on:
            frontend_argv.append(flag)
    if args.chat_template is not None:
        frontend_argv += ["--chat-template", args.chat_template]
    if args.trust_request_chat_template:
        frontend_argv.append("--trust-request-chat-template")
    frontend_argv += ["--chat-template-content-format", args.chat_template_content_format,
                      "--limit-mm-per-prompt", json.dumps({"image": args.limit_mm_per_prompt})]
    if args.allowed_local_media_path is not None:
        frontend_argv += ["--allowed-local-media-path", args.allowed_local_media_path]
    for flag, value in (("--reasoning-parser", args.reasoning_parser),
                        ("--tool-call-parser", args.tool_call_parser)):
        if value is not None:
            frontend_argv += [flag, value]
    frontend_argv += ["--reasoning-field", args.reasoning_field,
                      "--max-stored-responses", str(args.max_stored_responses),
                      "--generation-config", args.generation_config,
                      *_limit_argv(args)]
    if args.override_generation_config is not None:
        frontend_argv += ["--override-generation-config", args.override_generation_config]
    keys = _api_keys(args)
    if keys:
        os.environ["SLUICE_API_KEY"] = ",".join(keys)
    # Every frontend `serve` starts shares one metrics directory (req L-3).
    prepare_prometheus_dir()
    # --data-parallel-size N: N engines, each on its own address, and the frontend on all.
    n = args.data_parallel_size
    if n > 1 and (args.nnodes > 1 or args.master_port is not None):
        # Each engine's ranks meet on a port of their own, on this machine.
        raise SystemExit("sluice: --data-parallel-size with --nnodes or --master-port: "
                         "start each engine with `sluice engine` instead")
    addresses = [address, *(new_ipc_address("engine") for _ in range(n - 1))]
    for extra in addresses[1:]:
        frontend_argv += ["--engine-address", extra]
    frontend_argv += ["--routing", args.routing, "--migration-limit", str(args.migration_limit),
                      "--engine-timeout", str(args.engine_timeout)]
    at = engine_argv.index("--engine-address") + 1
    engine_argvs = [[*engine_argv[:at], a, *engine_argv[at + 1:]] for a in addresses]
    for i, argv in enumerate(engine_argvs):  # vLLM's data-parallel ranks: engine-0, -1...
        argv += ["--engine-id", f"engine-{i}"]
    worker_argvs = []
    postproc_addresses: list[str] = []
    if args.postproc_workers > 0:
        postproc_addresses = [new_ipc_address("postproc") for _ in addresses]
        for argv, postproc_address in zip(engine_argvs, postproc_addresses, strict=True):
            argv += ["--postproc-address", postproc_address]
        # Every worker registers with every engine.
        worker_argvs = [["postproc", *common,
                         *(x for a in postproc_addresses for x in ("--engine-postproc-address", a))]
                        ] * args.postproc_workers
    shares = _engine_shares(args, n)
    for argv, (_, cpus) in zip(engine_argvs, shares, strict=True):
        if cpus and args.threads is None:
            argv += ["--threads", str(len(cpus))]

    def start(argv: list[str], share=(None, None)) -> subprocess.Popen:
        env, cpus = share
        return subprocess.Popen([sys.executable, "-m", "shared.cli", *argv],
                                env=None if env is None else {**os.environ, **env},
                                **_child_of_serve(cpus))

    ipc_files = [*addresses, result_address, *postproc_addresses]
    try:
        children = [start(engine_argvs[0], shares[0]), start(frontend_argv),
                    *(start(argv, share) for argv, share in zip(engine_argvs[1:], shares[1:],
                                                                strict=True)),
                    *(start(argv) for argv in worker_argvs)]
        # The frontend (children[1]) drains first, while the engines still run its requests.
        return _supervise(children, drain_first=children[1:2],
                          grace_s=args.shutdown_timeout + 5)
    finally:
        for ipc in ipc_files:
            remove_ipc_file(ipc)


def _child_of_serve(cpus: list[int] | None) -> dict:
    """Popen arguments for a process `serve` starts: in its own process group, so a
    terminal's Ctrl+C reaches only `serve`, which stops its children in order (the frontend
    drains while the engines still run its requests); and dying with `serve`, should it be
    killed outright (Linux's parent-death signal)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def in_child() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return {"process_group": 0, "preexec_fn": in_child}


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _engine_shares(args, n: int) -> list[tuple[dict | None, list[int] | None]]:
    """(environment, CPUs) for each of `serve`'s n engines: one GPU each on CUDA
    (CUDA_VISIBLE_DEVICES), else an equal share of this process's CPUs each; nothing to
    change for one engine."""
    if n == 1:
        return [(None, None)]
    if resolve_device(args.device).startswith("cuda"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            gpus = [g.strip() for g in visible.split(",") if g.strip()]
        else:
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        k = args.tensor_parallel_size // args.nnodes  # each engine's ranks here: a GPU each
        if len(gpus) < n * k:
            raise SystemExit(f"sluice: --data-parallel-size {n} needs {n * k} GPUs "
                             f"({k} per engine), {len(gpus)} visible")
        return [({"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * k:(i + 1) * k])}, None)
                for i in range(n)]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return [(None, [cpus[i % len(cpus)]]) for i in range(n)]
    per = len(cpus) // n
    return [(None, cpus[i * per:(i + 1) * per]) for i in range(n)]


def _supervise(children: list[subprocess.Popen],
               drain_first: list[subprocess.Popen] | None = None, grace_s: float = 10) -> int:
    """Watch the children; on a signal (or one child's exit) stop them: `drain_first` gets
    the very signal serve got (its log names it) and may drain, then the others stop. A
    second signal goes straight to `drain_first`, which then exits at once."""
    drain_first = drain_first or []
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        if len(received) > 1:
            for child in drain_first:
                if child.poll() is None:
                    child.send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    while not received:
        exited = [c for c in children if c.poll() is not None]
        if exited:
            code = exited[0].returncode or 1
            break
        time.sleep(0.2)
    if received:
        logging.getLogger("sluice").info(
            "%s: stopping (the frontend drains, then the engines stop)",
            signal.Signals(received[0]).name)
    _stop(drain_first, grace_s, received[0] if received else signal.SIGTERM)
    _stop([c for c in children if c not in drain_first], 10)
    return code


def _stop(children: list[subprocess.Popen], timeout_s: float,
          signum: int = signal.SIGTERM) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signum)
    for child in children:
        try:
            child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.command == "bench":
        from shared.bench import run_bench

        result = run_bench(args)
        return 0 if result.errors == 0 else 1
    _setup_logging(args.log_level)
    for note in args.compat_notes:
        logging.getLogger("sluice").info("%s", note)
    check_startup(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "engine":
        from engine.server import run_engine

        run_engine(engine_config(args, args.engine_address, args.postproc_address))
        return 0
    if args.command == "postproc":
        from postproc.worker import run_postproc

        run_postproc(_tokenizer_path(args, _model_names(args)[0]),
                     args.engine_postproc_address or [DEFAULT_POSTPROC_ADDRESS])
        return 0
    if args.command == "frontend":
        prepare_prometheus_dir()  # before frontend.* imports prometheus_client
        from frontend.server import run_frontend

        run_frontend(frontend_config(args, args.engine_address, args.result_address))
        return 0
    return 2


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
