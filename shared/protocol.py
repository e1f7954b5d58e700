"""Wire protocol between frontends, the engine and postproc workers.

Every message is a tagged msgspec Struct so one socket can carry several kinds; the codec in
`shared.codec` encodes them with msgpack. Token ids travel as raw little-endian int32 buffers
(`TokenIds`), never as lists of Python ints, because a long prompt as a list costs far more to
encode and decode than the model step it feeds.
"""

from __future__ import annotations

import msgspec
import numpy as np

# Raw int32 little-endian token ids. Use `pack_ids` / `unpack_ids`.
TokenIds = bytes


def pack_ids(ids) -> TokenIds:
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(buf: TokenIds) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the engine needs to pick and stop tokens; the frontend pins every default."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    # Penalties: presence/frequency count output tokens only; repetition counts prompt and
    # output (SPEC P-11).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, ids already checked against the vocabulary, bias in [-100, 100].
    logit_bias: list[tuple[int, float]] = []
    # Top alternatives to report per generated token; None = no logprobs at all, 0 = only the
    # sampled token's logprob.
    logprobs: int | None = None
    # Same for prompt tokens (completions `echo` with logprobs).
    prompt_logprobs: int | None = None


class TokenLogprobs(msgspec.Struct, frozen=True):
    """Logprobs of k consecutive tokens, as raw buffers.

    token_logprobs: float32[k], the chosen token's logprob (NaN for a prompt's first token);
    top_ids: int32[k * n] and top_logprobs: float32[k * n], the n best alternatives of each
    position in descending order (n = the request's logprobs; 0 leaves them empty).
    """

    token_logprobs: bytes
    top_ids: bytes = b""
    top_logprobs: bytes = b""


class OutputParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a request's tokens become text: what the postproc step needs, not the engine."""

    skip_special_tokens: bool = True
    stop: list[str] = []  # stop strings, matched on detokenized text
    include_stop_str_in_output: bool = False
    logprobs: bool = False  # attach token strings to the logprobs the engine sends


# ---------------------------------------------------------------- frontend -> engine


class EngineRequest(msgspec.Struct, tag="request", frozen=True):
    request_id: str
    prompt_token_ids: TokenIds
    params: SamplingParams
    # Where frames for this request go: the frontend's result socket. The engine (or the
    # postproc worker it assigns) connects there lazily and pushes.
    reply_to: str
    arrival_time: float
    # What a postproc worker needs to turn tokens into text for this request.
    output: OutputParams = OutputParams()
    # Passed through untouched (SPEC P-12): the salt joins the root of the request's
    # prefix-cache hash chain, so tenants with different salts never share cached pages;
    # priority orders the waiting queue under a priority scheduler (lower runs first, as vLLM).
    cache_salt: str | None = None
    priority: int = 0


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Heartbeat from a frontend; the engine answers with `EngineStats`."""

    sender_id: str
    sent_at: float


# ---------------------------------------------------------------- engine -> frontend


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
    # With logprobs requested: one entry per token in new_token_ids.
    logprobs: TokenLogprobs | None = None
    # With prompt_logprobs requested, on the first output only: one entry per prompt token.
    prompt_logprobs: TokenLogprobs | None = None
    cumulative_logprob: float | None = None


class OutputBatch(msgspec.Struct, tag="outputs", frozen=True):
    """All outputs of one engine step bound for one destination."""

    outputs: list[RequestOutput]
    step_time: float


# ---------------------------------------------------------------- postproc -> frontend


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str  # the token's own text (byte-level pieces decoded as far as they go)
    logprob: float


class LogprobEntry(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    logprob: float  # NaN for a prompt's first token, which has no logprob
    top: list[TopLogprob]


class TextFrame(msgspec.Struct, frozen=True, omit_defaults=True):
    """Text produced from a request's tokens: what a postproc worker sends a frontend.

    Frames carry sequence numbers so a frontend can drop duplicates when a dead worker's
    requests are replayed on another one.
    """

    request_id: str
    seq: int
    text: str
    token_ids: TokenIds
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_status: int = 0
    first_token_time: float | None = None
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry] | None = None
    cumulative_logprob: float | None = None


class FrameBatch(msgspec.Struct, tag="frames", frozen=True):
    frames: list[TextFrame]


EngineInbound = EngineRequest | AbortRequest | Ping
FrontendInbound = OutputBatch | FrameBatch | EngineStats
