"""Settings of each process, as Structs the CLI fills in (see each tier's `flags.py`)."""

from __future__ import annotations

import msgspec

from shared.kv_events import KvEventsConfig
from shared.protocol import LoraAdapterInfo
from shared.speculative import SpeculativeConfig


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str  # resolved path: a .gguf file or an HF folder
    served_model_name: str
    tokenizer: str | None = None  # --tokenizer's resolved path; None: the model's
    request_address: str  # the engine binds a ROUTER here; frontends connect
    dtype: str = "auto"
    # --quantization: checked against the checkpoint's quantization_config; None: its own.
    quantization: str | None = None
    device: str = "cpu"
    attention_backend: str = "auto"  # auto | torch | flashinfer (see engine.attention.selector)
    page_size: int = 16
    kv_cache_memory_gb: float = 1.0  # on CPU; on CUDA gpu_memory_utilization sizes the cache
    # --kv-cache-dtype (engine.attention.kv_dtype): auto = dtype's; fp8 / int8 one byte.
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory: weights, KV, activations
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    # --batch-invariant: a request's logits do not depend on what shares its step (kernels
    # with one fixed sum order per row; see docs/batch-invariance.md).
    batch_invariant: bool = False
    num_pages: int | None = None  # overrides kv_cache_memory_gb (tests use it to starve memory)
    max_model_len: int | None = None  # default: the model's context length
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    scheduling_policy: str = "fcfs"
    # Per-step cap on a long prefill while others want to run; None: max_num_batched_tokens
    # // 4, 0: no cap (engine.step.scheduler).
    long_prefill_token_threshold: int | None = None
    # A frontend silent this long has its requests aborted (engine.process.server).
    frontend_timeout_s: float = 10.0
    # SIGTERM: how long the engine runs what it holds before exiting (frontends move the rest).
    shutdown_timeout_s: float = 30.0
    threads: int | None = None
    # --seed: seeds torch's default generators at start, which requests without their own
    # seed draw from, so a run repeats (vLLM's --seed). None: not seeded.
    seed: int | None = None
    max_logprobs: int = 20  # --max-logprobs; -1: up to the vocabulary
    # --speculative-config (shared.speculative, engine.step.spec_decode); None: no drafts.
    speculative: SpeculativeConfig | None = None
    engine_id: str = "engine-0"
    # --metrics-port: the engine's own Prometheus /metrics (its series once per engine, not
    # once per frontend); None: not served.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Where postproc workers connect (the engine binds a ROUTER); None = no fleet.
    postproc_address: str | None = None
    # vLLM's --runner (shared.runner_config): auto | generate | pooling; and --pooler-config's
    # JSON (None: the checkpoint's sentence-transformers files, else last-token + normalize).
    runner: str = "auto"
    pooler_config: str | None = None
    hf_overrides: str | None = None  # --hf-overrides' JSON: a decoder as a yes/no reranker
    # LoRA (--enable-lora, engine.step.lora_adapters): adapters loaded at start (--lora-modules),
    # distinct adapters in one step, the largest rank taken, most adapters loaded at once (0: any).
    enable_lora: bool = False
    lora_modules: list[LoraAdapterInfo] = []
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    # Tensor parallelism (engine.parallel): ranks of this one engine, over `nnodes` machines
    # (this one `node_rank`), meeting at master_addr:master_port (None: localhost, a free
    # port on one machine; torchrun's 29500 over several).
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # --kv-events-config (shared.kv_events; engine.process.kv_events): None, no events. Its
    # ports are offset by --data-parallel-rank, which its batches also carry.
    kv_events: KvEventsConfig | None = None
    data_parallel_rank: int = 0
    tokenizer_mode: str = "auto"  # --tokenizer-mode (shared.tokenizer_modes)
    # --profile-dir (engine.process.profiler): where /start_profile's traces go; None: off.
    profile_dir: str | None = None


# Frontend routes that answer without an API key and while draining: probes, scrapes and the
# schema. Here, below both the frontend (auth, admission) and the CLI (--api-key's help).
OPEN_PATHS = ("/health", "/ping", "/load", "/metrics", "/version", "/openapi.json")


class HttpSettings(msgspec.Struct, kw_only=True):
    """How uvicorn listens: vLLM's --root-path, --uds, --ssl-* and --uvicorn-log-level."""

    root_path: str = ""
    uds: str | None = None  # a Unix socket instead of host:port
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE
    log_level: str = "info"
    access_log: bool = True  # uvicorn's line per request (--disable-uvicorn-access-log)


class FrontendConfig(msgspec.Struct, kw_only=True):
    model: str
    # --allow-runtime-lora-updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.
    allow_runtime_lora_updating: bool = False
    served_model_name: str  # the name responses carry
    engine_address: str
    # Every --engine-address (each a zmq address or dns+tcp://NAME:PORT); empty: just
    # engine_address. `routing` picks one per request (frontend.engine_client.placement).
    engine_addresses: list[str] = []
    routing: str = "prefix"
    tokenizer: str | None = None  # --tokenizer's resolved path; None: the model's
    served_model_aliases: list[str] = []  # further names requests may use (--served-model-name)
    host: str = "127.0.0.1"
    port: int = 8000
    # Where engine/postproc frames for this frontend arrive; default: a fresh address.
    result_address: str | None = None
    tokenizer_threads: int = 4
    render_timeout_s: float = 30.0  # a chat render running longer fails its request
    chat_template: str | None = None  # --chat-template: a file path or the template itself
    trust_request_chat_template: bool = False  # honour a request's chat_template
    chat_template_content_format: str = "auto"  # auto | string | openai (frontend.input.rendering)
    # Image parts (frontend.input.media): the folder file:// URLs may read (None: none), and the
    # most images one prompt may carry (--limit-mm-per-prompt).
    allowed_local_media_path: str | None = None
    limit_mm_per_prompt: int = 8
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0  # an engine silent this long is not live
    # --engine-timeout: how long requests wait for an engine when none is live, and
    # --migration-limit: how often one started request may move to another engine.
    engine_timeout_s: float = 30.0
    migration_limit: int = 3
    log_level: str = "info"
    # Output parsers by name (postproc.reasoning / postproc.tool_parsers); None = off.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    reasoning_field: str = "reasoning_content"  # vLLM now says "reasoning"
    # /v1/responses with store: how many the embedded state store keeps (LRU); 0: none.
    max_stored_responses: int = 1000
    # The state store (frontend.state.store): its URL (None: sqlite in the state dir), how
    # long stored responses live (0: no expiry), and the largest one stored object.
    state_store: str | None = None
    responses_ttl_s: float = 30 * 24 * 3600.0
    max_stored_bytes: int = 16 * 2**20
    # Files and batches (frontend.batches; docs/batches.md): bounds on an upload, on the
    # unfinished batches in the store, on what one frontend runs at once, and their TTL.
    max_batch_file_bytes: int = 100 * 2**20
    max_batch_lines: int = 50_000
    max_active_batches: int = 100
    max_running_batches: int = 2
    max_batch_lines_in_flight: int = 4
    batch_ttl_s: float = 30 * 24 * 3600.0
    max_conversation_items: int = 10_000  # items one /v1/conversations conversation holds
    conversation_ttl_s: float = 0.0  # kept this long after its last change; 0: no expiry
    # --generation-config auto|vllm|FOLDER and --override-generation-config JSON
    # (shared.generation_config): sampling defaults for fields a request leaves out.
    generation_config: str = "auto"
    override_generation_config: str | None = None
    response_role: str = "assistant"  # --response-role
    default_chat_template_kwargs: dict = {}  # under each request's chat_template_kwargs
    log_requests: bool = False  # --enable-log-requests (frontend.engine_client.request_log)
    log_outputs: bool = False  # --enable-log-outputs
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N"
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    force_include_usage: bool = False  # --enable-force-include-usage
    http: HttpSettings = msgspec.field(default_factory=HttpSettings)
    # --export-engine-metrics: this frontend's /metrics carries its engine's series too, as
    # `sluice serve` (one frontend, one scrape target) wants; see frontend.http.metrics.
    export_engine_metrics: bool = False
    # Limits and security (frontend.http.auth, frontend.http.limits); see docs/operations.md.
    api_keys: list[str] = []  # empty: no authentication
    allowed_origins: list[str] = []  # CORS; empty: no CORS headers at all
    allowed_methods: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    max_request_body_bytes: int = 32 * 2**20
    max_queued_requests: int | None = None  # admitted requests not yet generating; None: no cap
    request_timeout_s: float | None = None  # from arrival to the last token; None: no limit
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may still run
    # Bounds per request (frontend.input.input_bounds, docs/operations.md): JSON nesting, fan-out.
    max_json_depth: int = 64
    # Pooling models (shared.runner_config): --runner, --pooler-config, and the most inputs
    # one /v1/embeddings request may carry.
    runner: str = "auto"
    pooler_config: str | None = None
    hf_overrides: str | None = None  # --hf-overrides' JSON: a decoder as a yes/no reranker
    max_embedding_inputs: int = 2048
    max_n: int = 128  # n and best_of
    max_prompts_per_request: int = 128
    max_messages: int = 2048
    max_tools: int = 128
    max_stop_strings: int = 64
    max_logprobs: int = 20  # --max-logprobs; -1: up to the vocabulary
    # --api-keys-file (frontend.http.key_table): per-key limits; the budgets live in the
    # state store, and a store that does not answer fails "open" (admit) or "closed" (503).
    api_keys_file: str | None = None
    rate_limit_store_failure: str = "open"
    # --disable-web-ui: no playground at / and no dashboard at /dashboard (frontend.web).
    disable_web_ui: bool = False
    tokenizer_mode: str = "auto"  # --tokenizer-mode (shared.tokenizer_modes)
    # --health-generate-timeout: /health_generate's one-token probe answers 503 after this.
    health_generate_timeout_s: float = 10.0
