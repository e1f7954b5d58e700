"""Every OpenAI response body: chunks, whole answers, logprobs (req O-4), errors, models.

They live in postproc because whoever post-processes a request (a postproc worker, or the
frontend's receiver thread without a fleet) writes the streamed chunks, and postproc may not
import the frontend. The frontend builds its whole answers and its other bodies from this
module too, so a whole answer and a streamed one are made of the same Structs, and
`frontend.base.api_models` holds requests only.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from postproc.tool_parsers.base import ToolCall
from shared.protocol import LogprobEntry, ToolCallDelta

# ---------------------------------------------------------------- chunks and whole answers


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens the prefix cache already held


class CompletionTokensDetails(msgspec.Struct):
    # Output tokens the reasoning parser read as reasoning (docs/parsers.md says which).
    reasoning_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # With --enable-prompt-tokens-details (vLLM's), in whole answers and final usage chunks.
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET
    # For a request that runs a reasoning parser.
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class Delta(msgspec.Struct, omit_defaults=True):
    # Omitted rather than null when absent: the first chunk carries the role only. Thinking
    # goes in whichever of the two reasoning fields the server is configured to write.
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None
    # With return_token_ids (vLLM's): this chunk's tokens; UNSET fields are left out.
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None  # OpenAI's field; null, as vLLM's
    # With return_token_ids, on a choice's opening chunk only, as vLLM.
    prompt_token_ids: list[int] | UnsetType = UNSET


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # null, not absent, when the answer is all tool calls (OpenAI's shape)
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: Any = None
    # vLLM's fields are always there, null unless asked for (return_token_ids,
    # prompt_logprobs), so a client written for vLLM can read them unconditionally.
    token_ids: list[int] | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None  # OpenAI's field; null, as vLLM's
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: Any = None
    # vLLM's fields, null unless asked for (return_token_ids, prompt_logprobs), in answers
    # and chunks alike: a stream's first chunk per choice has the prompt's ids.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(msgspec.Struct):
    """A completions response, and (with one choice) a streamed completions chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    system_fingerprint: str | None = None  # OpenAI's field; null, as vLLM's


# ---------------------------------------------------------------- logprobs


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def chat_logprobs(entries: list[LogprobEntry]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatLogprobEntry(
                token=e.token,
                logprob=e.logprob,
                bytes=list(e.token.encode("utf-8")),
                top_logprobs=[
                    TopLogprobOut(t.token, t.logprob, list(t.token.encode("utf-8")))
                    for t in e.top
                ],
            )
            for e in entries
        ]
    )


def completion_logprobs(entries: list[LogprobEntry], start_offset: int) -> CompletionLogprobs:
    """text_offset counts characters from the start of the choice's text."""
    offsets, position = [], start_offset
    for e in entries:
        offsets.append(position)
        position += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[_finite(e.logprob) for e in entries],
        # The sampled token is always there, then the alternatives (as OpenAI's legacy
        # API and vLLM: logprobs 0 gives the sampled token alone, not {}).
        top_logprobs=[
            {e.token: e.logprob, **{t.token: t.logprob for t in e.top if t.token != e.token}}
            if math.isfinite(e.logprob) else None
            for e in entries
        ],
        text_offset=offsets,
    )


class PromptLogprob(msgspec.Struct):
    """One token of vLLM's prompt_logprobs: its logprob, rank and text."""

    logprob: float
    rank: int
    decoded_token: str


def prompt_logprobs(entries: list[LogprobEntry]) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: None for the first token (nothing predicts it), then each
    token's own logprob and rank, and the most likely alternatives (ranks 1, 2, ...)."""
    out: list[dict[str, PromptLogprob] | None] = []
    for e in entries:
        if not math.isfinite(e.logprob):
            out.append(None)
            continue
        position = {str(t.token_id): PromptLogprob(t.logprob, rank, t.token)
                    for rank, t in enumerate(e.top, start=1)}
        position[str(e.token_id)] = PromptLogprob(e.logprob, e.rank, e.token)
        out.append(position)
    return out


def reasoning_delta(field: str, text: str) -> dict[str, str]:
    """Keyword arguments that put thinking in the configured field of a Delta or message."""
    return {field: text} if text else {}


# ---------------------------------------------------------------- the other bodies


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class ModelCard(msgspec.Struct):
    """vLLM's model card: `root` is the model the server loaded (what --model named),
    `parent` a base model (LoRA adapters; none here)."""

    id: str
    created: int  # when this server started, in seconds
    max_model_len: int
    root: str
    object: str = "model"
    owned_by: str = "sluice"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs (vLLM's): null otherwise


class DetokenizeResponse(msgspec.Struct):
    prompt: str
