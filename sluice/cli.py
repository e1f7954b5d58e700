"""The `sluice` console script: serve (all on one machine), engine, frontend, postproc, bench.

Each tier gives its subcommand as a `shared.command_line.Command` beside its code
(`engine/process/flags.py`, `frontend/http/flags.py`, `postproc/flags.py`: flags, start-up
checks, run); this module, above every tier, lists them, parses, dispatches, and holds
`serve`, which starts the others as processes (`python -m sluice ...`) and watches them. A
tier's code is imported only when its subcommand runs, so `sluice --help` loads no model code.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import time

import msgspec

from engine.process import flags as engine_cli
from engine.process.flags import (
    add_engine_arguments,
    engine_config,
    kv_cache_memory_gb,
    resolve_device,
)
from engine.process.lora_flags import add_lora_engine_arguments, check_lora_flags, lora_engine_argv
from frontend.http import flags as frontend_cli
from frontend.http.flags import (
    add_frontend_arguments,
    add_routing_arguments,
    batch_argv,
    frontend_config,
)
from frontend.http.limit_flags import api_keys, limit_argv, limit_config
from postproc import flags as postproc_cli
from shared.command_line import (
    DEFAULT_ENGINE_ADDRESS,
    VLLM_NOOP_FLAGS,
    VLLM_UNSUPPORTED_FLAGS,
    Command,
    add_model_arguments,
    add_model_tag,
    int_at_least,
    model_names,
    new_parser,
    parse_command_line,
    runner_of,
)
from shared.command_line import setup_logging as _setup_logging
from shared.prometheus_dir import prepare_prometheus_dir
from shared.startup_checks import check_model
from shared.tracing_flags import tracing_argv
from shared.transport import new_ipc_address, remove_ipc_file

# Names tests and tools reach through this module, the one every command goes through.
__all__ = ["DEFAULT_ENGINE_ADDRESS", "VLLM_NOOP_FLAGS", "VLLM_UNSUPPORTED_FLAGS", "build_parser",
           "check_startup", "engine_config", "frontend_config", "limit_argv", "limit_config",
           "main", "model_names", "parse_args", "resolve_device"]


def add_serve_command(serve) -> None:
    add_model_tag(serve)
    add_model_arguments(serve)
    add_engine_arguments(serve)
    add_frontend_arguments(serve)
    add_lora_engine_arguments(serve)
    frontend_cli.add_lora_frontend_arguments(serve)
    serve.add_argument("--postproc-workers", type=int_at_least(0), default=0,
                       help="postproc worker processes to start (default: %(default)s, the "
                            "frontend post-processes on its receiver thread)")
    serve.add_argument("--data-parallel-size", "-dp", type=int_at_least(1), default=1,
                       help="engines to start, each on its own GPU (CUDA) or its own share "
                            "of the CPUs, all behind the frontend (default: %(default)s)")
    add_routing_arguments(serve)


def check_serve(args) -> None:
    """Every process `serve` starts, checked before it starts any."""
    check_model(args)
    engine_cli.check_engine(args)
    frontend_cli.check_frontend(args)


def add_bench_command(bench) -> None:
    from sluice.bench.chat import add_bench_arguments

    add_bench_arguments(bench)


def run_bench_command(args) -> int:
    from sluice.bench.command import run_bench

    return 0 if run_bench(args).errors == 0 else 1


COMMANDS = {c.name: c for c in [
    # `lambda`: the module's `_serve` at call time (tests replace it).
    Command("serve", "engine + frontend (+ postproc workers) on this machine (over ipc)",
            add_serve_command, lambda args: _serve(args), check=check_serve,
            validate=check_lora_flags),
    engine_cli.COMMAND,
    frontend_cli.COMMAND,
    postproc_cli.COMMAND,
    Command("bench", "load-test any OpenAI-compatible server", add_bench_command,
            run_bench_command, serves=False),
]}


def build_parser():
    return new_parser(list(COMMANDS.values()))


def parse_args(argv: list[str]):
    """Parse a command line the way `main` does: vLLM spellings, --config, positional MODEL."""
    return parse_command_line(build_parser(), argv, COMMANDS)


def check_startup(args) -> None:
    """The one pass of start-up checks for the command's processes (shared.startup_checks)."""
    COMMANDS[args.command].check(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = COMMANDS[args.command]
    if not command.serves:
        return command.run(args)
    # The process's role (serve, engine, frontend, postproc) is its subcommand.
    _setup_logging(args.log_level, args.log_format, args.command)
    try:
        for note in args.compat_notes:
            logging.getLogger("sluice").info("%s", note)
        check_startup(args)
        return command.run(args)
    except SystemExit as exc:
        if args.log_format != "json" or not isinstance(exc.code, str):
            raise
        # A refusal's one line ("sluice: ..."), as a JSON line like every other.
        logging.getLogger("sluice").error("%s", exc.code)
        return 1


def _serve(args) -> int:
    """Start engine and frontend as two processes over ipc and watch them."""
    address = new_ipc_address("engine")
    common = _common_argv(args)
    engine_argv = _engine_argv(args, common, address)
    # serve names every ipc socket its processes bind, so it can remove their files at exit
    # (a process that is killed leaves its socket file behind).
    result_address = new_ipc_address("frontend")
    frontend_argv = _frontend_argv(args, common, address, result_address)
    keys = api_keys(args)
    if keys:
        os.environ["SLUICE_API_KEY"] = ",".join(keys)
    # Every frontend `serve` starts shares one metrics directory (req L-3).
    prepare_prometheus_dir()
    # --data-parallel-size N: N engines, each on its own address, and the frontend on all.
    n = args.data_parallel_size
    _check_data_parallel(args, n)
    addresses = [address, *(new_ipc_address("engine") for _ in range(n - 1))]
    frontend_argv += _frontend_routing_argv(args, addresses[1:])
    engine_argvs = _engine_argvs(engine_argv, addresses)
    postproc_addresses, worker_argvs = _postproc_workers(args, common, engine_argvs)
    shares = _engine_shares(args, n)
    for argv, (_, cpus) in zip(engine_argvs, shares, strict=True):
        if cpus and args.threads is None:
            argv += ["--threads", str(len(cpus))]
    ipc_files = [*addresses, result_address, *postproc_addresses]
    try:
        children = [_start(engine_argvs[0], shares[0]), _start(frontend_argv),
                    *(_start(argv, share) for argv, share in zip(engine_argvs[1:], shares[1:],
                                                                 strict=True)),
                    *(_start(argv) for argv in worker_argvs)]
        if args.api_keys_file:  # `kill -HUP` on serve reloads the frontend's keys file
            signal.signal(signal.SIGHUP, lambda signum, frame: children[1].send_signal(signum))
        # The frontend (children[1]) drains first, while the engines still run its requests.
        return _supervise(children, drain_first=children[1:2],
                          grace_s=args.shutdown_timeout + FRONTEND_EXIT_S)
    finally:
        for ipc in ipc_files:
            remove_ipc_file(ipc)


def _given(pairs) -> list[str]:
    """`[flag, value, ...]` for each (flag, value) whose value was given (is not None)."""
    return [x for flag, value in pairs if value is not None for x in (flag, str(value))]


def _switches(pairs) -> list[str]:
    """The flags of the (flag, on) pairs that are on."""
    return [flag for flag, on in pairs if on]


def _common_argv(args) -> list[str]:
    """The flags every process `serve` starts reads alike: the model and how to load it."""
    common = ["--log-level", args.log_level, "--log-format", args.log_format]
    if args.model:
        common += ["--model", args.model]
    if args.served_model_name:
        common += ["--served-model-name", *args.served_model_name]
    common += _given((("--revision", args.revision), ("--download-dir", args.download_dir),
                      ("--tokenizer", args.tokenizer)))
    common += ["--tokenizer-mode", args.tokenizer_mode]
    common += ["--runner", runner_of(args),  # pooling: every process reads it alike
               "--max-embedding-inputs", str(args.max_embedding_inputs)]
    common += tracing_argv(args)  # every process traces its own part of a request
    return common + _given((("--pooler-config", args.pooler_config),
                            ("--hf-overrides", args.hf_overrides)))


def _engine_argv(args, common: list[str], address: str) -> list[str]:
    """`sluice engine`'s command line for the engine on `address`."""
    engine_argv = [
        "engine", *common, "--engine-address", address, "--dtype", args.dtype,
        "--device", args.device, "--page-size", str(args.page_size),
        "--kv-cache-memory-gb", str(kv_cache_memory_gb(args)),
        "--kv-cache-dtype", args.kv_cache_dtype,
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
    engine_argv += _given((("--num-kv-pages", args.num_kv_pages),
                           ("--master-addr", args.master_addr),
                           ("--master-port", args.master_port),
                           ("--max-model-len", args.max_model_len), ("--threads", args.threads),
                           ("--long-prefill-token-threshold",
                            args.long_prefill_token_threshold),
                           ("--seed", args.seed), ("--profile-dir", args.profile_dir),
                           ("--quantization", args.quantization)))
    engine_argv += _switches((("--enforce-eager", args.enforce_eager),
                              ("--batch-invariant", args.batch_invariant)))
    if args.speculative_config is not None:
        engine_argv += ["--speculative-config",
                        msgspec.json.encode(args.speculative_config).decode()]
    if args.kv_events_config is not None:  # each engine offsets its ports by its rank
        engine_argv += ["--kv-events-config", msgspec.json.encode(args.kv_events_config).decode()]
    return engine_argv + lora_engine_argv(args)


def _frontend_argv(args, common: list[str], address: str, result_address: str) -> list[str]:
    """`sluice frontend`'s command line, on the first engine's `address` (the others are
    added with the routing flags)."""
    return ["frontend", *common, "--engine-address", address,
            "--result-address", result_address, *_frontend_http_argv(args),
            *_frontend_chat_argv(args), *_frontend_records_argv(args)]


def _frontend_http_argv(args) -> list[str]:
    """Where and how the frontend listens."""
    return [
        "--host", args.host,
        "--port", str(args.port), "--tokenizer-threads", str(args.tokenizer_threads),
        "--render-timeout", str(args.render_timeout),
        "--max-logprobs", str(args.max_logprobs), "--response-role", args.response_role,
        "--health-generate-timeout", str(args.health_generate_timeout),
        "--root-path", args.root_path, "--ssl-cert-reqs", str(args.ssl_cert_reqs),
        # One frontend on one port: its /metrics is the engine's too, as `vllm serve`'s.
        "--export-engine-metrics",
        *_given((("--uds", args.uds), ("--ssl-keyfile", args.ssl_keyfile),
                 ("--ssl-certfile", args.ssl_certfile), ("--ssl-ca-certs", args.ssl_ca_certs),
                 ("--uvicorn-log-level", args.uvicorn_log_level))),
        *_switches((("--disable-web-ui", args.disable_web_ui),)),
        *_switches((("--disable-uvicorn-access-log", args.disable_uvicorn_access_log),)),
    ]


def _frontend_chat_argv(args) -> list[str]:
    """How the frontend renders requests, logs them and parses answers."""
    argv = []
    if args.default_chat_template_kwargs:
        argv += ["--default-chat-template-kwargs", json.dumps(args.default_chat_template_kwargs)]
    argv += _switches((("--enable-log-requests", args.enable_log_requests),
                       ("--enable-log-outputs", args.enable_log_outputs),
                       ("--return-tokens-as-token-ids", args.return_tokens_as_token_ids),
                       ("--enable-prompt-tokens-details", args.enable_prompt_tokens_details),
                       ("--enable-force-include-usage", args.enable_force_include_usage)))
    argv += _given((("--chat-template", args.chat_template),))
    argv += _switches((("--trust-request-chat-template", args.trust_request_chat_template),
                       ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating)))
    argv += ["--chat-template-content-format", args.chat_template_content_format,
             "--limit-mm-per-prompt", json.dumps({"image": args.limit_mm_per_prompt})]
    return argv + _given((("--allowed-local-media-path", args.allowed_local_media_path),
                          ("--reasoning-parser", args.reasoning_parser),
                          ("--tool-call-parser", args.tool_call_parser)))


def _frontend_records_argv(args) -> list[str]:
    """What the frontend keeps (stored responses, conversations, batches), its generation
    defaults and its per-request limits."""
    return ["--reasoning-field", args.reasoning_field,
            "--max-stored-responses", str(args.max_stored_responses),
            "--responses-ttl", str(args.responses_ttl),
            "--max-stored-bytes", str(args.max_stored_bytes),
            "--max-conversation-items", str(args.max_conversation_items),
            "--conversation-ttl", str(args.conversation_ttl),
            "--generation-config", args.generation_config,
            *batch_argv(args), *limit_argv(args),
            *_given((("--override-generation-config", args.override_generation_config),
                     ("--state-store", args.state_store)))]


def _check_data_parallel(args, n: int) -> None:
    if n > 1 and (args.nnodes > 1 or args.master_port is not None):
        # Each engine's ranks meet on a port of their own, on this machine.
        raise SystemExit("sluice: --data-parallel-size with --nnodes or --master-port: "
                         "start each engine with `sluice engine` instead")


def _frontend_routing_argv(args, more_engines: list[str]) -> list[str]:
    """The frontend's further engines and how it places requests on them."""
    return [*(x for a in more_engines for x in ("--engine-address", a)),
            "--routing", args.routing, "--migration-limit", str(args.migration_limit),
            "--engine-timeout", str(args.engine_timeout)]


def _engine_argvs(engine_argv: list[str], addresses: list[str]) -> list[list[str]]:
    """One engine's command line per address, each named as vLLM's data-parallel ranks
    are: engine-0, engine-1... (and ranked so: their KV-event ports differ)."""
    at = engine_argv.index("--engine-address") + 1
    return [[*engine_argv[:at], a, *engine_argv[at + 1:], "--engine-id", f"engine-{i}",
             "--data-parallel-rank", str(i)]
            for i, a in enumerate(addresses)]


def _postproc_workers(args, common: list[str], engine_argvs: list[list[str]]
                      ) -> tuple[list[str], list[list[str]]]:
    """With --postproc-workers: each engine's postproc address (added to its command line)
    and the workers' command lines; every worker registers with every engine."""
    if args.postproc_workers <= 0:
        return [], []
    postproc_addresses = [new_ipc_address("postproc") for _ in engine_argvs]
    for argv, postproc_address in zip(engine_argvs, postproc_addresses, strict=True):
        argv += ["--postproc-address", postproc_address]
    worker_argv = ["postproc", *common,
                   *(x for a in postproc_addresses for x in ("--engine-postproc-address", a))]
    return postproc_addresses, [worker_argv] * args.postproc_workers


def _start(argv: list[str], share=(None, None)) -> subprocess.Popen:
    """`python -m sluice <argv>`, with the share's environment and CPUs (`_engine_shares`)."""
    env, cpus = share
    return subprocess.Popen([sys.executable, "-m", "sluice", *argv],
                            env=None if env is None else {**os.environ, **env},
                            **_child_of_serve(cpus))


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
# How long the frontend may take to exit once its drain window (--shutdown-timeout) is over
# before serve kills it: up to 2 s for its last error frames to go out, uvicorn's 5 s for
# open connections, then its clean-up (the batch and background-response runners, the state
# store, the engine client, the grammar checker's process), all slower on a loaded host.
FRONTEND_EXIT_S = 30


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
            # Said, so a process that vanished without its clean-up is not a mystery.
            logging.getLogger("sluice").warning(
                "%s (pid %d) did not exit within %gs of the signal: killing it",
                _label(child), child.pid, timeout_s)
            child.kill()
            child.wait()


def _label(child: subprocess.Popen) -> str:
    """The subcommand of a process `serve` started (`python -m sluice engine ...`)."""
    args = [str(a) for a in child.args] if isinstance(child.args, list) else [str(child.args)]
    return args[3] if args[1:3] == ["-m", "sluice"] and len(args) > 3 else args[0]


