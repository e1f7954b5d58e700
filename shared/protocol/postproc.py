"""Engine <-> postproc worker, and postproc -> frontend: the work and the text frames."""

from __future__ import annotations

import msgspec

from shared.protocol.engine_outputs import RequestOutput
from shared.protocol.params import TokenIds
from shared.protocol.requests import EngineRequest, RawTensor


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
