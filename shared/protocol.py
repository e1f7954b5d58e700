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


class Constraint(msgspec.Struct, frozen=True):
    """A grammar the output must follow (req P-8, C-1 to C-3).

    The frontend translates the request (response_format, structured_outputs, guided_*, forced
    tool calls) into one llguidance grammar and validates it, so the engine only compiles it.
    """

    kind: str  # what asked for it: json_object | json_schema | regex | choice | grammar | tools
    grammar: str  # llguidance's grammar format (a JSON document or a Lark grammar)


class ThinkingBudget(msgspec.Struct, frozen=True):
    """vLLM's thinking_token_budget: after `budget` thinking tokens the engine writes
    `end_ids` (the reasoning parser's end tag) to close the section (engine.request.thinking)."""

    budget: int
    start_ids: list[int]  # the parser's start tag, which opens a section
    end_ids: list[int]
    starts_inside: bool = False  # the rendered prompt already opened one


# One definition of greedy for every tier: a temperature below this takes the argmax (as
# vLLM's _SAMPLING_EPS); dividing logits by it would only overflow float32 anyway.
GREEDY_TEMPERATURE = 1e-5


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
    # output (req P-11).
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
    # The output must follow this grammar: a mask on the logits before sampling.
    constraint: Constraint | None = None
    # vLLM's allowed_token_ids: only these may be drawn (empty: any).
    allowed_token_ids: list[int] = []
    # vLLM's bad_words, tokenized by the frontend: the last token of each sequence is
    # banned wherever the output so far ends with the ones before it.
    bad_words: list[list[int]] = []
    thinking: ThinkingBudget | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class TokenLogprobs(msgspec.Struct, frozen=True):
    """Logprobs of k consecutive tokens, as raw buffers.

    token_logprobs: float32[k], the chosen token's logprob (NaN for a prompt's first token);
    top_ids: int32[k * n] and top_logprobs: float32[k * n], the n best alternatives of each
    position in descending order (n = the request's logprobs; 0 leaves them empty).
    """

    token_logprobs: bytes
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    ranks: bytes = b""  # int32[k], prompt logprobs only: each token's rank (0: none)


class ChunkFormat(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to write a streamed candidate's OpenAI chunks, so whoever post-processes it (a
    postproc worker, or the frontend's receiver thread) hands the HTTP layer finished bytes."""

    kind: str  # "chat" | "completion"
    response_id: str
    created: int
    model: str
    index: int  # the choice index this candidate streams as
    logprobs: bool = False  # put logprobs in the chunks
    continuous_usage: bool = False  # usage in every chunk (stream_options)
    echo: str = ""  # completions: the prompt text, before the first chunk's text
    reasoning_field: str = "reasoning_content"
    # vLLM's return_token_ids: each chunk names its tokens' ids; a completion's first chunk
    # also the prompt's (a chat stream's opening chunk, written by the frontend, has those).
    token_ids: bool = False


class OutputParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a request's tokens become text: what the postproc step needs, not the engine."""

    skip_special_tokens: bool = True
    stop: list[str] = []  # stop strings, matched on detokenized text
    include_stop_str_in_output: bool = False
    # The request's min_tokens: no stop string ends it before that many tokens (req P-9).
    min_tokens: int = 0
    logprobs: bool = False  # attach token strings to the logprobs the engine sends
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N", not their text
    # (for tokens whose text is not valid UTF-8 on its own).
    tokens_as_ids: bool = False
    # Output parsers by registered name (req O-5, O-6); None = off for this request.
    reasoning_parser: str | None = None
    # Whether the output starts inside a thinking block, as the frontend read it from the
    # rendered prompt (a template may pre-fill `<think>` or a closed block).
    starts_in_reasoning: bool = False
    tool_parser: str | None = None
    tools: bytes = b""  # the request's `tools` as JSON (parsers read parameter types)
    # Text the server put after the rendered prompt that the output continues (a forced
    # call's opening, req C-3): parsed as output, never returned as content.
    tool_prefill: str = ""
    chunk: ChunkFormat | None = None  # set for streamed requests only


# ---------------------------------------------------------------- frontend -> engine


# Element types a RawTensor may carry, with their sizes (numpy has no bfloat16).
TENSOR_DTYPES = {"float32": 4, "float16": 2, "bool": 1}


class RawTensor(msgspec.Struct, frozen=True, array_like=True):
    """An array as raw little-endian bytes with its shape and dtype: never pickled (a peer's
    pickle could run code) and never a JSON-style list (megabytes of floats). Receivers
    check it with `unpack_tensor` before use."""

    data: bytes
    shape: list[int]
    dtype: str  # a TENSOR_DTYPES key


def pack_tensor(array: np.ndarray) -> RawTensor:
    array = np.ascontiguousarray(array)
    dtype = "bool" if array.dtype == np.bool_ else array.dtype.name
    if dtype not in TENSOR_DTYPES:
        raise ValueError(f"cannot send a {dtype} tensor")
    return RawTensor(array.astype(array.dtype.newbyteorder("<")).tobytes(), list(array.shape),
                     dtype)


def unpack_tensor(tensor: RawTensor) -> np.ndarray:
    """The array a RawTensor holds; ValueError when dtype, shape and byte count disagree."""
    size = TENSOR_DTYPES.get(tensor.dtype)
    if size is None:
        raise ValueError(f"tensor dtype must be one of {sorted(TENSOR_DTYPES)}")
    if not tensor.shape or any(d < 1 for d in tensor.shape):
        raise ValueError("tensor dimensions must be positive")
    count = 1
    for d in tensor.shape:
        count *= d
    if count * size != len(tensor.data):
        raise ValueError(f"tensor of shape {tensor.shape} and dtype {tensor.dtype} needs "
                         f"{count * size} bytes, not {len(tensor.data)}")
    kind = np.bool_ if tensor.dtype == "bool" else np.dtype(tensor.dtype).newbyteorder("<")
    return np.frombuffer(tensor.data, dtype=kind).reshape(tensor.shape)


class ImageInput(msgspec.Struct, frozen=True):
    """One image of a prompt, as the model's image processor left it (Idefics3: the tiles
    and the global view), and where its placeholder tokens sit in the prompt: the span
    [offset, offset + length) from its first to its last token, whose image-token
    positions take the vision encoder's outputs in order."""

    pixel_values: RawTensor  # [patches, channels, height, width]
    pixel_attention_mask: RawTensor  # [patches, height, width] bool: real pixels
    offset: int
    length: int


class Continuation(msgspec.Struct, frozen=True):
    """A request moved to this engine mid-stream (its engine died, froze or drained): what it
    had generated so far, which the client already has. The engine prefills prompt + these
    and goes on with the next token as if it had drawn them itself (usage, max_tokens,
    penalties, stops and a seeded draw at each position all count them); whoever
    post-processes it first replays them as the frames the client got (`frame_sizes`
    tokens each), so the text goes on where it stopped and frame numbers line up."""

    output_token_ids: TokenIds
    frame_sizes: list[int]  # tokens per frame already delivered; they sum to the ids' count
    cumulative_logprob: float = 0.0


class PoolingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """A pooling request (vLLM's --runner pooling): prefill only, and the pooled hidden state
    comes back instead of tokens. How the states are pooled is the model's (engine.step.pooler)."""

    # embed: the pooled hidden state; a cross-encoder's classify or score: the sigmoid of
    # its one logit, else the softmax over its labels (vLLM's).
    task: str = "embed"
    normalize: bool | None = None  # None: as the model's pooler config says
    dimensions: int | None = None  # Matryoshka: keep the first n, then normalize
    # An encoder's segment of each prompt token (int32, as TokenIds); empty: all 0. A
    # query-document pair's second segment is 1 for BERT cross-encoders.
    token_type_ids: bytes = b""


class TraceContext(msgspec.Struct, frozen=True, array_like=True):
    """W3C trace context as its two headers (shared.trace_context reads them): the span
    a request's work in the next process is the child of."""

    traceparent: str
    tracestate: str = ""


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
    # Passed through untouched (req P-12): the salt joins the root of the request's
    # prefix-cache hash chain, so tenants with different salts never share cached pages;
    # priority orders the waiting queue under a priority scheduler (lower runs first, as vLLM).
    cache_salt: str | None = None
    priority: int = 0
    # A multimodal prompt's images, in prompt order (req T-13); the engine checks them.
    images: list[ImageInput] = []
    # Set when the request continues a stream another engine started (frontend migration).
    continuation: Continuation | None = None
    # Set for a pooling request (an embedding); a pooling engine takes nothing else.
    pooling: PoolingParams | None = None
    # The LoRA adapter to run it with, by name (the request's `model`); None: the base model.
    lora_name: str | None = None
    # Set when the frontend traces it: the engine's and the postproc worker's spans join it.
    trace_context: TraceContext | None = None
    # TensorRT-LLM's scheduling_params.priority_tier (0-15): under the priority scheduler a
    # higher tier runs before every lower one, `priority` ordering within a tier.
    priority_tier: int = 0


class AbortRequest(msgspec.Struct, tag="abort", frozen=True):
    """From a frontend (the client left) or a postproc worker (a stop string matched)."""

    request_ids: list[str]


class LoraAdapterInfo(msgspec.Struct, frozen=True):
    """A LoRA adapter an engine serves: its name (what requests send as `model`), its PEFT
    folder and, optionally, the model it was trained on (vLLM's base_model_name)."""

    name: str
    path: str
    base_model_name: str | None = None


class LoraUpdate(msgspec.Struct, tag="lora_update", frozen=True):
    """From a frontend: load (`path` set) or unload an adapter at run time; the engine
    answers with a `LoraUpdateResult` carrying the same `op_id`."""

    op_id: str
    action: str  # "load" | "unload"
    name: str
    path: str = ""


class Ping(msgspec.Struct, tag="ping", frozen=True):
    """Heartbeat from a frontend; the engine answers with `EngineStats`."""

    sender_id: str
    sent_at: float


# ---------------------------------------------------------------- engine -> frontend


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


# ---------------------------------------------------------------- engine <-> postproc


class WorkerHeartbeat(msgspec.Struct, tag="worker_heartbeat", frozen=True):
    """A postproc worker's registration and heartbeat, on its DEALER to the engine."""

    worker_id: str
    sent_at: float


class WorkerDone(msgspec.Struct, tag="worker_done", frozen=True):
    """Requests whose last frame a worker has sent: the engine may forget their outputs.
    Until then it keeps them, to replay on another worker should this one die."""

    request_ids: list[str]


class WorkBatch(msgspec.Struct, tag="work", frozen=True):
    """What the engine sends one postproc worker after a step.

    `assignments` are requests this worker takes on from now (new ones, or a dead worker's
    being replayed: then `outputs` holds all their outputs so far, in order). `reset` tells a
    worker the engine had given it up for dead: it drops every request it still holds.
    """

    assignments: list[EngineRequest]
    outputs: list[RequestOutput]
    step_time: float
    reset: bool = False


# ---------------------------------------------------------------- postproc -> frontend


class FunctionCallDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """One entry of a chat chunk's `delta.tool_calls`; encodes to OpenAI's shape."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str  # the token's own text (byte-level pieces decoded as far as they go)
    logprob: float


class LogprobEntry(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    logprob: float  # NaN for a prompt's first token, which has no logprob
    top: list[TopLogprob]
    rank: int = 0  # prompt logprobs: the token's rank (1: the likeliest); 0: not known


class TextFrame(msgspec.Struct, frozen=True, omit_defaults=True):
    """Text produced from a request's tokens: what a postproc worker sends a frontend.

    Frames carry sequence numbers so a frontend can drop duplicates when a dead worker's
    requests are replayed on another one.
    """

    request_id: str
    seq: int
    text: str  # content (after the reasoning and tool parsers took their parts)
    token_ids: TokenIds
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_status: int = 0
    first_token_time: float | None = None
    num_cached_tokens: int | None = None  # on the first frame: prompt tokens found cached
    logprobs: list[LogprobEntry] | None = None
    prompt_logprobs: list[LogprobEntry] | None = None
    cumulative_logprob: float | None = None
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = []
    # Streamed requests: this frame as ready-to-write SSE bytes (empty: nothing to send).
    chunk: bytes = b""
    pooled: RawTensor | None = None  # a pooling request's vector (RequestOutput.pooled)
    # Of the output tokens so far, those the reasoning parser read as reasoning (the section
    # markers left out); None when the request runs no reasoning parser.
    num_reasoning_tokens: int | None = None


class FrameBatch(msgspec.Struct, tag="frames", frozen=True):
    frames: list[TextFrame]


class LoraUpdateResult(msgspec.Struct, tag="lora_result", frozen=True):
    """An engine's answer to a LoraUpdate: status 200, or the HTTP status of the problem."""

    op_id: str
    status: int
    message: str = ""


class EngineCommand(msgspec.Struct, tag="engine_command", frozen=True):
    """From a frontend: an operator's command for the engine itself (TensorRT-LLM's and
    vLLM's /start_profile, /stop_profile, /energy_metrics; vLLM's /reset_prefix_cache); the
    engine answers with an `EngineCommandResult` carrying the same `op_id`."""

    op_id: str
    command: str  # "start_profile" | "stop_profile" | "read_energy" | "reset_prefix_cache"


class EnergyReading(msgspec.Struct, frozen=True):
    """One energy counter of the engine's machine: joules since the counter's own origin
    (a RAPL domain, or a GPU since its driver loaded), monotonic but for wrap-arounds."""

    source: str  # e.g. "rapl:package-0", "nvml:gpu-0"
    energy_j: float


class EngineCommandResult(msgspec.Struct, tag="command_result", frozen=True):
    """An engine's answer to an EngineCommand: status 200, or the HTTP status of the problem
    (404: the engine has nothing to do it with, 400 or 409: not now)."""

    op_id: str
    status: int
    message: str = ""
    energy: list[EnergyReading] = []  # read_energy's readings
    path: str = ""  # stop_profile: the trace file written


EngineInbound = EngineRequest | AbortRequest | Ping | LoraUpdate | EngineCommand
FrontendInbound = OutputBatch | FrameBatch | EngineStats | LoraUpdateResult | EngineCommandResult
WorkerInbound = WorkBatch
EngineFromWorker = WorkerHeartbeat | WorkerDone | AbortRequest
