"""`sluice frontend`: the frontend's flags, its start-up checks and its config.

`sluice serve` takes the same frontend flags (`add_frontend_arguments`,
`add_routing_arguments`) and forwards them. Nothing of the frontend is imported until
`run_frontend_command` runs: the Prometheus directory must be set first.
"""

from __future__ import annotations

import argparse
import json
import os

from frontend.http.limit_flags import add_http_arguments, add_limit_arguments, limit_config
from shared.command_line import (
    DEFAULT_ENGINE_ADDRESS,
    Command,
    add_model_arguments,
    int_at_least,
    int_in,
    json_object,
    model_names,
    positive_number,
    runner_of,
    seconds,
    tokenizer_path,
)
from shared.config import FrontendConfig, HttpSettings
from shared.prometheus_dir import prepare_prometheus_dir
from shared.startup_checks import (
    StartupError,
    check_generation_config,
    check_listen_address,
    check_model,
)
from shared.transport import free_tcp_port


def add_frontend_command(frontend: argparse.ArgumentParser) -> None:
    add_model_arguments(frontend)
    add_frontend_arguments(frontend)
    add_lora_frontend_arguments(frontend)
    frontend.add_argument("--engine-address", action="append", default=None,
                          help="an engine to use; repeat for several, or give "
                               "dns+tcp://NAME:PORT for every address NAME resolves to "
                               "(re-resolved, so engines may join and leave; a Kubernetes "
                               f"headless Service) (default: {DEFAULT_ENGINE_ADDRESS})")
    add_routing_arguments(frontend)
    frontend.add_argument("--export-engine-metrics", action="store_true",
                          help="also export the engine's series (from its heartbeat) on this "
                               "frontend's /metrics: right for one frontend per engine (serve "
                               "sets it); with several, scrape the engine's --metrics-port, "
                               "or sums count the engine once per frontend")
    frontend.add_argument("--result-address", default=None,
                          help="where this frontend receives outputs; must be reachable from "
                               "the engine (default: ipc next to an ipc engine, otherwise "
                               "tcp://127.0.0.1 on a free port)")


def run_frontend_command(args) -> int:
    prepare_prometheus_dir()  # before frontend.* imports prometheus_client
    from frontend.http.server import run_frontend
    from shared.tracing import start_tracing

    start_tracing("sluice-frontend", args.otlp_traces_endpoint, f"{args.host}:{args.port}")

    run_frontend(frontend_config(args, args.engine_address, args.result_address))
    return 0


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


def _role(text: str) -> str:
    """--response-role: a role name; empty or blank would give messages no role at all."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the role may not be empty")
    return text


def _state_store_url(text: str) -> str:
    """An argparse type: a --state-store URL of a kind frontend.state.store opens."""
    if text == "memory://" or (text.startswith("sqlite:///") and len(text) > 10) or \
            text.startswith(("redis://", "rediss://", "unix://")):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected sqlite:///PATH, redis://HOST:PORT/DB or memory://")


# LoRA's run-time routes (issue 36): vLLM's flag, or its environment switch.
LORA_RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def add_lora_frontend_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   default=os.environ.get(LORA_RUNTIME_ENV, "").lower() in ("1", "true"),
                   help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
                        f"on when {LORA_RUNTIME_ENV}=True, as vLLM)")


def add_frontend_arguments(p: argparse.ArgumentParser) -> None:
    # One "frontend" group in --help, filled in this order by the helpers below.
    g = p.add_argument_group("frontend")
    _add_server_arguments(g)
    _add_chat_input_arguments(g)
    _add_parser_arguments(g)
    _add_store_arguments(g)
    _add_generation_default_arguments(g)
    _add_output_arguments(g)
    _add_web_ui_arguments(g)
    _add_probe_arguments(g)
    add_http_arguments(p)
    add_limit_arguments(p)


def _add_probe_arguments(g) -> None:
    """TensorRT-LLM's /health_generate (frontend.http.engine_ops)."""
    g.add_argument("--health-generate-timeout", type=positive_number, default=10.0,
                   help="seconds /health_generate's one-token generation may take before "
                        "it answers 503 (default: %(default)s)")


def _add_server_arguments(g) -> None:
    """Where the HTTP server listens, and the threads that render requests."""
    g.add_argument("--host", default=os.environ.get("SLUICE_HOST", "127.0.0.1"),
                   help="address the HTTP server binds (default: $SLUICE_HOST, else "
                        "127.0.0.1; the images set SLUICE_HOST=0.0.0.0)")
    g.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="port the HTTP server listens on")
    g.add_argument("--tokenizer-threads", type=int_at_least(1), default=4,
                   help="threads that render and tokenize requests (default: %(default)s)")
    g.add_argument("--render-timeout", type=positive_number, default=30.0,
                   help="seconds a chat template may take to render before its request fails "
                        "with a 400 and its thread is replaced; a request that waits this "
                        "long for a free render thread gets a 503 instead (default: %(default)s)")


def _add_chat_input_arguments(g) -> None:
    """Chat templates and media: how a request becomes a prompt."""
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


def _add_parser_arguments(g) -> None:
    """The output parsers (postproc): thinking and tool calls."""
    g.add_argument("--reasoning-parser", default=None,
                   choices=["deepseek_r1", "openai_gptoss", "qwen3",
                            "deepseek_v3", "glm45", "granite", "kimi_k2"],
                   help="split the model's thinking from its answer (default: off; "
                        "openai_gptoss for a gpt-oss model)")
    g.add_argument("--reasoning-field", default="reasoning_content",
                   choices=["reasoning_content", "reasoning"],
                   help="the response field that carries thinking (default: %(default)s, "
                        "as DeepSeek, SGLang and llama.cpp; vLLM now says reasoning)")
    g.add_argument("--tool-call-parser", default=None,
                   choices=["hermes", "llama3_json", "mistral", "openai", "pythonic",
                            "qwen3_coder", "deepseek_v3", "deepseek_v31", "glm45", "granite",
                            "kimi_k2", "llama4_json", "llama4_pythonic"],
                   help="turn the model's tool-call syntax into tool_calls (default: off, "
                        "openai for a gpt-oss model; without one, tools are only accepted "
                        "with tool_choice none)")


def _add_store_arguments(g) -> None:
    """What the state store keeps: responses, batches, conversations."""
    g.add_argument("--max-stored-responses", type=int_at_least(0), default=1000,
                   help="stored /v1/responses the embedded state store (sqlite, memory) "
                        "keeps, least recently used dropped first; 0 stores none (default: "
                        "%(default)s; Redis bounds memory with its own maxmemory policy)")
    # The shared state store (frontend.state.store): stored responses, background work.
    g.add_argument("--state-store", type=_state_store_url, default=None, metavar="URL",
                   help="where stored responses live: sqlite:///PATH (one host, survives "
                        "restarts), redis://HOST:PORT/DB (many frontends), or memory:// "
                        "(this process only); default: sqlite in $SLUICE_STATE_DIR, else "
                        "~/.local/state/sluice/state.db")
    g.add_argument("--responses-ttl", type=seconds, default=30 * 24 * 3600.0,
                   metavar="SECONDS",
                   help="how long a stored response is kept; 0: until evicted or deleted "
                        "(default: 30 days, as OpenAI)")
    g.add_argument("--max-stored-bytes", type=int_at_least(1024), default=16 * 2**20,
                   help="the largest one stored object may be, encoded; a larger response is "
                        "returned with store false (default: 16 MiB)")
    _add_batch_arguments(g)
    g.add_argument("--max-conversation-items", type=int_at_least(1), default=10_000,
                   help="items one /v1/conversations conversation may hold; adding more is "
                        "a 400 (default: %(default)s)")
    g.add_argument("--conversation-ttl", type=seconds, default=0.0, metavar="SECONDS",
                   help="how long a /v1/conversations conversation is kept after its last "
                        "change; 0: until evicted or deleted (default: 0, as OpenAI's, which "
                        "do not expire)")


def _add_generation_default_arguments(g) -> None:
    """Defaults a request gets for the fields it leaves out."""
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
    g.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                   metavar="JSON",
                   help="chat_template_kwargs every chat request gets, under its own, e.g. "
                        "'{\"enable_thinking\": false}' (default: none)")


def _add_output_arguments(g) -> None:
    """Request logging and what every answer carries."""
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


def _add_web_ui_arguments(g) -> None:
    """The pages a browser opens (frontend.web)."""
    g.add_argument("--disable-web-ui", action="store_true",
                   help="serve no playground at / and no dashboard at /dashboard (they "
                        "are on by default, and need --api-key's key for their API calls)")


# The Files and Batch APIs (frontend.batches): flag -> (FrontendConfig field, type, default, help).
_BATCH_FLAGS = {
    "--max-batch-file-bytes": ("max_batch_file_bytes", int_at_least(1), 100 * 2**20,
                               "the largest file /v1/files takes, in bytes (past it: a 413; "
                               "--max-request-body-bytes bounds the upload too)"),
    "--max-batch-lines": ("max_batch_lines", int_at_least(1), 50_000,
                          "requests one batch input file may hold (OpenAI's 50,000)"),
    "--max-active-batches": ("max_active_batches", int_at_least(1), 100,
                             "unfinished batches in the state store, every frontend's "
                             "together; past it creating one is a 429"),
    "--max-running-batches": ("max_running_batches", int_at_least(1), 2,
                              "batches this frontend runs at once; the others wait for a "
                              "frontend with room"),
    "--max-batch-lines-in-flight": ("max_batch_lines_in_flight", int_at_least(1), 4,
                                    "batch requests this frontend has in the engines at once, "
                                    "all its batches together: what interactive requests share "
                                    "the engines with"),
    "--batch-ttl": ("batch_ttl_s", seconds, 30 * 24 * 3600.0,
                    "seconds files, batches and their output files are kept; 0: until "
                    "deleted (default: 30 days)"),
}


def _add_batch_arguments(g) -> None:
    for flag, (dest, kind, default, what) in _BATCH_FLAGS.items():
        g.add_argument(flag, type=kind, default=default, dest=dest,
                       help=f"{what} (default: %(default)s)")


def batch_config(args) -> dict:
    return {dest: getattr(args, dest) for dest, _, _, _ in _BATCH_FLAGS.values()}


def batch_argv(args) -> list[str]:
    """The batch flags, for the frontend `sluice serve` starts."""
    return [x for flag, (dest, _, _, _) in _BATCH_FLAGS.items()
            for x in (flag, str(getattr(args, dest)))]


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", choices=["prefix", "least-loaded", "round-robin", "kv"],
                   default="prefix",
                   help="how a frontend picks an engine per request: prefix (the same first "
                        "prompt pages and cache_salt prefer the same engine, bounded by "
                        "load), least-loaded, round-robin, or kv (the engine whose KV-cache "
                        "events say it holds the longest run of the prompt's pages, bounded "
                        "by load, else as prefix; the engines need --kv-events-config) "
                        "(default: %(default)s)")
    # Migration (frontend.engine_client.migration): what a frontend does when an engine is lost.
    p.add_argument("--migration-limit", type=int_at_least(0), default=3,
                   help="how many times one streaming request may move to another engine "
                        "when its engine dies, freezes or drains: it goes on there with the "
                        "tokens generated so far; past the limit it ends with an error "
                        "(default: %(default)s; 0: never move a started request; "
                        "vLLM/Dynamo's name)")
    p.add_argument("--engine-timeout", type=seconds, default=30.0,
                   help="seconds requests wait for an engine when none answers (a frozen "
                        "or restarting one): in-flight requests go on when one is back, new "
                        "ones wait instead of a 503; then they end with an error "
                        "(default: %(default)s)")


def frontend_config(args, engine_address: str | list[str] | None,
                    result_address: str | None) -> FrontendConfig:
    path, names = model_names(args)
    addresses = ([engine_address] if isinstance(engine_address, str) else
                 list(engine_address or [DEFAULT_ENGINE_ADDRESS]))
    engine_address = addresses[0]
    if result_address is None and not all(a.startswith("ipc://") for a in addresses):
        result_address = f"tcp://127.0.0.1:{free_tcp_port()}"
    return FrontendConfig(
        model=path, tokenizer=tokenizer_path(args, path), served_model_name=names[0],
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
        state_store=args.state_store, responses_ttl_s=args.responses_ttl,
        max_stored_bytes=args.max_stored_bytes, **batch_config(args),
        max_conversation_items=args.max_conversation_items,
        conversation_ttl_s=args.conversation_ttl,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        response_role=args.response_role,
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        log_requests=args.enable_log_requests, log_outputs=args.enable_log_outputs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        force_include_usage=args.enable_force_include_usage,
        max_logprobs=args.max_logprobs,
        tokenizer_mode=getattr(args, "tokenizer_mode", "auto"),
        export_engine_metrics=getattr(args, "export_engine_metrics", False),
        engine_timeout_s=getattr(args, "engine_timeout", 30.0),
        migration_limit=getattr(args, "migration_limit", 3),
        allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", False),
        http=HttpSettings(root_path=args.root_path, uds=args.uds,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                          log_level=args.uvicorn_log_level or args.log_level,
                          access_log=not getattr(args, "disable_uvicorn_access_log", False)),
        runner=runner_of(args), pooler_config=getattr(args, "pooler_config", None),
        hf_overrides=getattr(args, "hf_overrides", None),
        max_embedding_inputs=getattr(args, "max_embedding_inputs", 2048),
        **limit_config(args),
        disable_web_ui=getattr(args, "disable_web_ui", False),
        health_generate_timeout_s=getattr(args, "health_generate_timeout", 10.0),
    )



# ---------------------------------------------------------------- start-up checks


def check_frontend(args) -> None:
    """The frontend's part of the start-up pass (shared.startup_checks), after the model's."""
    check_frontend_flags(args)
    check_generation_config(args)
    check_listen_address(args)


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


def check_frontend_command(args) -> None:
    check_model(args)
    check_frontend(args)


COMMAND = Command("frontend", "run one HTTP frontend against an engine", add_frontend_command,
                  run_frontend_command, check=check_frontend_command)
