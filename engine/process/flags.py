"""`sluice engine`: the engine's flags, its start-up checks and its config, beside its code.

`sluice serve` takes the same engine flags (`add_engine_arguments`) and forwards them.
"""

from __future__ import annotations

import argparse
import os
import socket

from engine.process.lora_flags import (
    add_lora_engine_arguments,
    check_lora_flags,
    lora_engine_config,
)
from engine.process.profiler import PROFILE_DIR_ENV
from shared.command_line import (
    DEFAULT_ENGINE_ADDRESS,
    DEFAULT_POSTPROC_ADDRESS,
    Command,
    add_model_arguments,
    add_model_tag,
    int_at_least,
    int_in,
    model_names,
    positive_number,
    runner_of,
    seconds,
    seed_value,
    share,
    tokenizer_path,
)
from shared.config import EngineConfig
from shared.kv_events import KvEventsConfig, KvEventsConfigError, parse_kv_events_config
from shared.speculative import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
    SpeculativeConfigError,
    parse_speculative_config,
)
from shared.speculative import FLAG as SPEC_FLAG
from shared.startup_checks import StartupError, check_model


def add_engine_command(engine: argparse.ArgumentParser) -> None:
    add_model_tag(engine)
    add_model_arguments(engine)
    add_engine_arguments(engine)
    add_lora_engine_arguments(engine)
    engine.add_argument("--engine-address", default=DEFAULT_ENGINE_ADDRESS,
                        help="where to bind for frontends (default: %(default)s)")
    engine.add_argument("--engine-id", default=None,
                        help="this engine's name in stats, metrics and logs (default: the "
                             "hostname plus --engine-address)")
    engine.add_argument("--postproc-address", default=None,
                        help="where to bind for postproc workers, e.g. "
                             f"{DEFAULT_POSTPROC_ADDRESS} (default: no fleet; frontends "
                             "post-process their own requests)")
    engine.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                        help="on SIGTERM, seconds the engine runs the requests it holds while "
                             "frontends send it nothing new; then it exits and frontends move "
                             "what is left to other engines (default: 30; a second SIGTERM: "
                             "at once)")
    engine.add_argument("--metrics-port", type=int_at_least(1), default=None,
                        help="serve the engine's Prometheus /metrics on this port (its series "
                             "once per engine, whatever the number of frontends; default: "
                             "not served)")
    engine.add_argument("--metrics-host", default=os.environ.get("SLUICE_HOST", "127.0.0.1"),
                        help="the address --metrics-port binds (default: $SLUICE_HOST, "
                             "else 127.0.0.1)")
    engine.add_argument("--data-parallel-rank", "-dpn", type=int_at_least(0), default=0,
                        help="this engine's data-parallel rank, as vLLM's: its KV-event "
                             "ports are --kv-events-config's plus the rank, and its event "
                             "batches carry it (default: %(default)s; `serve -dp N` gives "
                             "engine i rank i)")


def run_engine_command(args) -> int:
    from engine.process.server import run_engine
    from shared.log_format import set_process_fields
    from shared.tracing import start_tracing

    config = engine_config(args, args.engine_address, args.postproc_address)
    set_process_fields(engine_id=config.engine_id)  # on every log line from here on
    start_tracing("sluice-engine", args.otlp_traces_endpoint, config.engine_id)
    run_engine(config)
    return 0


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    _add_device_arguments(g)
    _add_step_arguments(g)
    _add_tensor_parallel_arguments(g)
    add_kv_events_arguments(g)
    _add_profiler_arguments(g)


def _add_profiler_arguments(g) -> None:
    """The torch profiler behind /start_profile and /stop_profile (engine.process.profiler)."""
    g.add_argument("--profile-dir", default=os.environ.get(PROFILE_DIR_ENV) or None,
                   help="open /start_profile and /stop_profile: the torch profiler runs in "
                        "the engine between them and writes a Chrome trace JSON here "
                        f"(default: ${PROFILE_DIR_ENV}, vLLM's; unset: the routes answer 404)")


def _add_device_arguments(g) -> None:
    """Where the engine runs, in what dtype and attention backend, and its KV cache's size."""
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
    g.add_argument("--page-size", "--block-size", type=int_at_least(1), default=16,
                   help="tokens per KV cache page (--block-size: vLLM's name)")
    g.add_argument("--kv-cache-memory-gb", type=positive_number, default=1.0,
                   help="memory for the KV cache on CPU, in GiB (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, default="auto",
                   help="how the KV cache is stored, as vLLM's: auto (--dtype's), bfloat16, "
                        "float16, fp8 (= fp8_e4m3), fp8_e5m2 or int8: one byte an element with "
                        "a scale per layer (the checkpoint's k_scale / v_scale, else fixed), "
                        "so --kv-cache-memory-gb holds 2x / 4x the pages of float16 / float32 "
                        "(torch attention backend; docs/models.md, *KV cache dtype*)")
    g.add_argument("--kv-cache-memory-bytes", type=int_at_least(1), default=None,
                   help="the same in bytes (vLLM's name); wins over --kv-cache-memory-gb")
    g.add_argument("--gpu-memory-utilization", type=share, default=0.9,
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
    g.add_argument("--num-kv-pages", "--num-gpu-blocks-override", type=int_at_least(1),
                   default=None,
                   help="exact number of KV pages (overrides --kv-cache-memory-gb; "
                        "--num-gpu-blocks-override: vLLM's name)")


def _add_step_arguments(g) -> None:
    """What one step holds and in which order requests run; threads, seed, drafts."""
    g.add_argument("--max-model-len", type=int_at_least(1), default=None,
                   help="longest prompt + answer in tokens (default: the model's context)")
    g.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=512,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                        "(default: %(default)s)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="queue order: arrival, or the request's priority (lower first), then "
                        "arrival")
    g.add_argument("--max-num-seqs", type=int_at_least(1), default=128,
                   help="most sequences in the running batch (default: %(default)s)")
    g.add_argument("--long-prefill-token-threshold", type=int_at_least(0), default=None,
                   help="while other requests want to run, a prompt with more tokens left "
                        "than this is prefilled at most this many tokens a step, one such "
                        "prompt at a time (default: a quarter of --max-num-batched-tokens; "
                        "0: no cap)")
    g.add_argument("--frontend-timeout", type=seconds, default=10.0,
                   help="seconds without a heartbeat after which the engine aborts a "
                        "frontend's requests (default: %(default)s; 0: never)")
    g.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch CPU threads (default: torch's choice, one per core; under "
                        "serve --data-parallel-size N, each engine's share of the CPUs)")
    g.add_argument("--seed", type=seed_value, default=None,
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


def _add_tensor_parallel_arguments(g) -> None:
    """Tensor parallelism (engine.parallel): one engine's model over several ranks, on
    this machine or over several, meeting through torch.distributed's TCP rendezvous."""
    g.add_argument("--tensor-parallel-size", "-tp", type=int_at_least(1), default=1,
                   help="ranks one engine's model is split over: one process per GPU on "
                        "CUDA (NCCL), each with an equal share of the CPUs otherwise (gloo); "
                        "rank 0 is the engine the frontends see (default: %(default)s)")
    g.add_argument("--nnodes", type=int_at_least(1), default=1,
                   help="machines the ranks of --tensor-parallel-size are spread over, an "
                        "equal number on each (default: %(default)s)")
    g.add_argument("--node-rank", type=int_at_least(0), default=0,
                   help="this machine's index among --nnodes; node 0 runs rank 0, the "
                        "engine; the others run `sluice engine` with the same flags and only "
                        "follow it (default: %(default)s)")
    g.add_argument("--master-addr", default=None,
                   help="the host of node 0, where the ranks meet (needed with --nnodes > "
                        "1; on one machine: loopback). torchrun's MASTER_ADDR, RANK, "
                        "WORLD_SIZE environment is taken instead when set")
    g.add_argument("--master-port", type=int_in(1, 65535), default=None,
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


# vLLM's --kv-cache-dtype values (engine.attention.kv_dtype.KV_CACHE_DTYPES; not imported,
# so parsing the flags does not import torch).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


def _kv_cache_dtype(text: str) -> str:
    if text not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return text


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return parse_speculative_config(text)
    except SpeculativeConfigError as exc:
        # argparse names the flag already.
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{SPEC_FLAG}: ")) from None


def resolve_device(name: str) -> str:
    """`auto`: cuda when torch sees a GPU, else cpu; anything else as given."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def kv_cache_memory_gb(args) -> float:
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes / 2**30
    return args.kv_cache_memory_gb


def engine_config(args, address: str, postproc_address: str | None = None) -> EngineConfig:
    path, names = model_names(args)
    return EngineConfig(
        model=path, tokenizer=tokenizer_path(args, path), served_model_name=names[0],
        request_address=address, dtype=args.dtype,
        device=resolve_device(args.device), attention_backend=args.attention_backend,
        page_size=args.page_size,
        kv_cache_memory_gb=kv_cache_memory_gb(args), num_pages=args.num_kv_pages,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        quantization=getattr(args, "quantization", None),
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
        runner=runner_of(args), pooler_config=getattr(args, "pooler_config", None),
        hf_overrides=getattr(args, "hf_overrides", None),
        **lora_engine_config(args),
        tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
        kv_events=args.kv_events_config,
        data_parallel_rank=getattr(args, "data_parallel_rank", 0),
        tokenizer_mode=getattr(args, "tokenizer_mode", "auto"),
        profile_dir=getattr(args, "profile_dir", None),
    )


# --- KV-cache events (issue 50): vLLM's --kv-events-config (shared.kv_events).


def add_kv_events_arguments(g) -> None:
    g.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help="publish KV-cache events for KV-aware routers, vLLM's JSON and wire "
                        'format: {"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
                        '"buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, '
                        '"topic": ""} (docs/observability.md). Default: off')


def _kv_events_config(text: str) -> KvEventsConfig:
    try:
        return parse_kv_events_config(text)
    except KvEventsConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---------------------------------------------------------------- start-up checks


def check_engine(args) -> None:
    """The engine's part of the start-up pass (shared.startup_checks), after the model's."""
    check_cpu_isa()
    check_device(args.device)
    check_batch_invariant(args)
    check_kv_cache_dtype(args)


def check_kv_cache_dtype(args) -> None:
    """A narrow KV cache (--kv-cache-dtype other than --dtype's) is stored on the torch
    backend: refused ahead of the load where the flags ask for what cannot read it."""
    name = getattr(args, "kv_cache_dtype", "auto")
    if name in ("auto", args.dtype):
        return
    if args.batch_invariant:
        raise StartupError(f"--kv-cache-dtype {name} cannot run with --batch-invariant: its "
                           "kernels read a float32 or bfloat16 KV cache only")
    if args.attention_backend == "flashinfer":
        raise StartupError(f"--kv-cache-dtype {name} is stored on the torch attention backend "
                           "only; use --attention-backend torch (or auto)")


def check_cpu_isa() -> None:
    """SLUICE_CPU_ISA names a target the kernels can be built for (engine.kernels.cpu_kernels); a
    misspelt one would otherwise end the engine in a ValueError traceback at its load."""
    from engine.kernels.cpu_kernels import target_isa

    try:
        target_isa()
    except ValueError as exc:
        raise StartupError(f"{exc}; unset it for this CPU's own") from None


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


def check_batch_invariant(args) -> None:
    """--batch-invariant on a CPU needs the compiled kernels, which SLUICE_CPU_KERNELS=0
    switches off (a failed build is only known once the engine tries it, and it says so)."""
    if not args.batch_invariant or args.device.startswith("cuda"):
        return
    from engine.kernels.cpu_kernels import enabled

    if not enabled() and (args.device == "cpu" or not _sees_cuda()):
        raise StartupError("--batch-invariant needs the engine's CPU kernels, which "
                           f"SLUICE_CPU_KERNELS={os.environ['SLUICE_CPU_KERNELS']} switches "
                           "off; unset it, or drop --batch-invariant")


def _sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_engine_command(args) -> None:
    check_model(args)
    check_engine(args)


COMMAND = Command("engine", "run the engine alone", add_engine_command, run_engine_command,
                  check=check_engine_command, validate=check_lora_flags)
