"""OpenAI request and response bodies as msgspec Structs.

Requests forbid unknown fields so a typo is a 400 naming the field, before any work. Fields of
the OpenAI API that we accept but do not honour yet are listed in `UNSUPPORTED_WHEN_SET`;
sending them with a non-default value is a 400 saying so, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# ---------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    user: str | None = None
    # vLLM-compatible extensions
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_token_ids: list[int] | str | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    functions: Any = None
    function_call: Any = None
    # Accepted and ignored: they change nothing about the tokens.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # vLLM-compatible chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False
    documents: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str, list[str], list[int] or list[list[int]]; msgspec allows one array type per
    # union, so the element kinds are checked when the prompt is read.
    prompt: str | list[str | int | list[int]] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


# Fields we know but cannot honour yet: (field, default) — a different value is a 400.
# Entries leave these lists as the features land; docs/openai-compat.md is checked against them.
UNSUPPORTED_WHEN_SET: tuple[tuple[str, Any], ...] = (
    ("truncate_prompt_tokens", None),
    ("guided_json", None),
    ("guided_regex", None),
    ("guided_choice", None),
    ("guided_grammar", None),
    ("structured_outputs", None),
)
CHAT_UNSUPPORTED_WHEN_SET: tuple[tuple[str, Any], ...] = (
    ("tools", None),
    ("functions", None),
    ("function_call", None),
    ("response_format", None),
    ("echo", False),
    ("continue_final_message", False),
    ("chat_template", None),
    ("documents", None),
    ("audio", None),
    ("prediction", None),
    ("web_search_options", None),
)


# ---------------------------------------------------------------- responses


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(msgspec.Struct):
    role: str
    content: str | None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: Any = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(msgspec.Struct, omit_defaults=True):
    # Omitted rather than null when absent: the first chunk carries the role only.
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: Any = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "sluice"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


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

