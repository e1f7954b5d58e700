"""Engine -> frontend: stats and the outputs of each step."""

from __future__ import annotations

import msgspec

from shared.protocol.params import TokenIds, TokenLogprobs
from shared.protocol.requests import LoraAdapterInfo, RawTensor


class HistogramCounts(msgspec.Struct, array_like=True, frozen=True):
    """One engine histogram: observations per bucket (the bounds of `shared.histograms`,
    then +Inf; not cumulative) and their sum."""

    counts: list[int]
    total: float


class EngineStats(msgspec.Struct, tag="stats", frozen=True):
    engine_id: str
    model_name: str
    max_model_len: int
    num_total_pages: int
    num_free_pages: int
    num_running: int
    num_waiting: int
    num_steps: int
    # Largest number of sequences seen in one model step since start: evidence of batching.
    max_seqs_in_step: int
    num_finished: int
    num_aborted: int
    sent_at: float
    num_preemptions: int = 0
    # Tokens fed through the model (prefill and decode); a prefix-cache hit skips some.
    num_computed_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    step_time_total_s: float = 0.0  # summed wall time of the num_steps model steps
    # The postproc fleet, as the engine sees it.
    num_postproc_workers: int = 0  # live workers now
    postproc_assigned: int = 0  # requests assigned to a worker since start
    postproc_replayed: int = 0  # of those, moved to another worker (or the frontend) on a death
    page_size: int = 0  # tokens per KV page (vLLM's block_size)
    # Per-step and per-request distributions (shared.histograms names them): tokens per step;
    # each request's queue, prefill, decode and inference time on the engine's clock.
    histograms: dict[str, HistogramCounts] = {}
    # SIGTERM: it finishes what it runs (for --shutdown-timeout) and takes nothing new.
    draining: bool = False
    # The LoRA adapters it serves now (the frontends' /v1/models lists these).
    lora_adapters: list[LoraAdapterInfo] = []
    # --kv-events-config: where its KV events are published and replayed ("": not; a
    # wildcard host means the host the engine is reached at), and batches it dropped.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_dropped: int = 0
    # shared.tokenizer.tokenizer_fingerprint of the tokenizer it loaded: a frontend that
    # renders with another refuses it. "": not reported (it is then taken on trust).
    tokenizer_fingerprint: str = ""
    # It drafts tokens (speculative decoding): beam search is refused there, as vLLM does.
    speculative: bool = False


class RequestOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """One step's new tokens for one request."""

    request_id: str
    new_token_ids: TokenIds
    num_prompt_tokens: int
    num_output_tokens: int  # total so far, including these
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None  # the stop token id that matched, if any
    error: str | None = None
    error_status: int = 0  # HTTP-style: 400 the request was at fault, 500/503 we were
    # Set on the first output of a request: when the engine produced its first token.
    first_token_time: float | None = None
    # Also on the first output: prompt tokens the prefix cache already held.
    num_cached_tokens: int | None = None
    # With logprobs requested: one entry per token in new_token_ids.
    logprobs: TokenLogprobs | None = None
    # With prompt_logprobs requested, on the first output only: one entry per prompt token.
    prompt_logprobs: TokenLogprobs | None = None
    cumulative_logprob: float | None = None
    # A pooling request's result, on its only output: float32[dimensions].
    pooled: RawTensor | None = None


class OutputBatch(msgspec.Struct, tag="outputs", frozen=True):
    """All outputs of one engine step bound for one destination."""

    outputs: list[RequestOutput]
    step_time: float
