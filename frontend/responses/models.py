"""OpenAI Responses API bodies as msgspec Structs (`/v1/responses`).

The request knows every top-level field of the current API and forbids unknown ones (req
P-1): hints and bookkeeping are accepted and ignored, features this server does not run are a
400 when set (`UNSUPPORTED_WHEN_SET`). Input items and tools are read leniently, because
clients send earlier output items back as input with every field they got (`status`,
`annotations`, `phase`, ...); an item's or tool's `type` decides whether it is supported.
`docs/responses-api.md` lists it all.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from frontend.base.api_models import NullMeansDefault
from shared.param_ranges import INT32_MAX
from shared.tool_specs import ToolName

# ---------------------------------------------------------------- requests

# An ignored count still has a range, so no field takes an integer of any size.
Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]


class InputPart(msgspec.Struct, kw_only=True):
    """A content part of an input message (input_text, output_text, refusal, ...), or of a
    reasoning item (reasoning_text, summary_text)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None  # input_image: a data:, http(s): or file: URL
    detail: str | None = None  # input_image: auto | low | high (changes nothing here)
    file_id: str | None = None  # input_image by uploaded file: refused (no file store)


class InputItem(NullMeansDefault, kw_only=True):
    """One input item: a message (`type` may be left out), a function_call, a
    function_call_output or a reasoning item."""

    type: str | None = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | list[InputPart] | None = None  # function_call_output
    summary: list[InputPart] | None = None  # reasoning


class FunctionTool(msgspec.Struct, kw_only=True):
    """A tool; only `type` "function" is served. Name, description and parameters follow
    the chat tools' rules (`shared.tool_specs`)."""

    type: str
    name: ToolName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and ignored


class ReasoningConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    effort: str | None = None  # reaches the template as chat's reasoning_effort
    summary: str | None = None  # accepted; the reasoning item carries the full text instead
    generate_summary: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_obfuscation: bool | None = None  # we never pad events: changes nothing


class ConversationRef(msgspec.Struct, forbid_unknown_fields=True):
    """`conversation` given as an object (`{"id": ...}`), and on the response."""

    id: str


class ResponsesRequest(NullMeansDefault, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = None
    # Accepted and ignored: bookkeeping, billing, caching and routing hints.
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    service_tier: str | None = None
    max_tool_calls: Count | None = None  # counts built-in tool calls; we have none
    access_programs: Any = None
    image: Any = None
    # Runs with no client waiting; polled, streamed and cancelled from any frontend.
    background: bool | None = None
    # A conversation's id (or {"id": ...}): its items come before the input, and the
    # response's input and output items are added to it.
    conversation: str | ConversationRef | None = None
    # Refused when set (UNSUPPORTED_WHEN_SET): features this server does not run.
    background_options: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    # vLLM-style extensions (names as in the chat API).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int | None = 0
    chat_template_kwargs: dict[str, Any] | None = None
    # Continue the last input message when it is the assistant's (a prefill), instead of
    # starting a new assistant turn.
    continue_final_message: bool | None = False


class InputTokensRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`POST /v1/responses/input_tokens`: what a create request's input would cost."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: str | ConversationRef | None = None


# (field, default): a different value is a 400 saying the feature is not supported.
UNSUPPORTED_WHEN_SET: tuple[tuple[str, Any], ...] = (
    ("background_options", None),
    ("prompt", None),
    ("context_management", None),
    ("moderation", None),
)
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {}


# ---------------------------------------------------------------- output items


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class MessageItem(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type"):
    id: str
    status: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    status: str
    call_id: str
    name: str
    arguments: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseFormatOut(msgspec.Struct, omit_defaults=True):
    type: str
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class TextOut(msgspec.Struct):
    format: ResponseFormatOut


class ResponseObject(msgspec.Struct):
    id: str
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "queued", "in_progress", "failed", "cancelled"]
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[Any]
    text: TextOut
    store: bool
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    temperature: float | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    user: str | None = None
    completed_at: int | None = None
    background: bool = False
    conversation: ConversationRef | None = None


class DeletedResponse(msgspec.Struct):
    id: str
    deleted: bool = True
    object: str = "response.deleted"


class InputTokens(msgspec.Struct):
    input_tokens: int
    object: str = "response.input_tokens"


# ---------------------------------------------------------------- stream events


class StreamError(msgspec.Struct, tag="error", tag_field="type"):
    """A failure after the stream started (OpenAI's `error` event)."""

    sequence_number: int
    message: str
    code: str | None = None
    param: str | None = None


class LifecycleEvent(msgspec.Struct):
    """response.created / in_progress / completed / incomplete / failed."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct):
    """response.output_item.added / done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(msgspec.Struct):
    """response.content_part.added / done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(msgspec.Struct, omit_defaults=True):
    """response.output_text.delta / response.reasoning_text.delta."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] | None = None  # output_text only: [] (logprobs are not offered)


class TextDoneEvent(msgspec.Struct, omit_defaults=True):
    """response.output_text.done / response.reasoning_text.done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] | None = None


class ArgumentsDeltaEvent(msgspec.Struct):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str
    type: str = "response.function_call_arguments.delta"


class ArgumentsDoneEvent(msgspec.Struct):
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str
    type: str = "response.function_call_arguments.done"
