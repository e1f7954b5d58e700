"""Anthropic Messages API bodies as msgspec Structs (`/v1/messages`, `/v1/messages/count_tokens`).

The request forbids unknown top-level fields, as the OpenAI models do (req P-1): a typo is a
400 naming it. Fields of Anthropic's API that change nothing here (metadata, service_tier,
cache_control, ...) are known and ignored; features we do not run (server tools, containers,
MCP servers, context management) are a 400 when set. Content blocks are read leniently (a
client sends back what it got, with fields such as `citations` or `caller`); their `type`
decides what is supported. `docs/anthropic-api.md` lists it all.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from frontend.base.api_models import NullMeansDefault
from frontend.base.errors import ErrorBody, ErrorDetail  # noqa: F401 (its face's error shape)
from shared.param_ranges import INT32_MAX
from shared.tool_specs import ToolName

# ---------------------------------------------------------------- requests

# An ignored count still has a range, so no field takes an integer of any size.
Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]


class ContentBlock(msgspec.Struct, kw_only=True):
    """One block of a message's content; which fields matter depends on `type`."""

    type: str
    text: str | None = None  # text
    thinking: str | None = None  # thinking
    signature: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    source: Any = None  # image: {type: base64, media_type, data} or {type: url, url}


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    """A client tool ({name, description, input_schema}); server tools have a versioned
    `type` (e.g. "web_search_20250305") and are refused. Name, description and schema follow
    the chat tools' rules (`shared.tool_specs`)."""

    name: ToolName
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Count | None = None  # thinking follows the template; ignored
    display: str | None = None


class OutputFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: OutputFormat | None = None
    effort: str | None = None  # a thinking-effort hint: nothing to tune here


class _MessageFields(NullMeansDefault, forbid_unknown_fields=True, kw_only=True):
    """What `/v1/messages` and `/v1/messages/count_tokens` share. A null means the field's
    default, as in the OpenAI bodies."""

    model: str
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's spelling
    # Accepted and ignored: hints and bookkeeping that change nothing about the tokens.
    cache_control: Any = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Refused when set: features this server does not run.
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None


class MessagesRequest(_MessageFields, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    # Older clients still send the sampling knobs; they work as in the chat API.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


class CountTokensRequest(_MessageFields, kw_only=True):
    pass


UNSUPPORTED_WHEN_SET = ("container", "mcp_servers", "context_management")


# ---------------------------------------------------------------- responses


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # nothing signs our thinking; clients may send it back as is


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


OutputBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(msgspec.Struct):
    id: str
    model: str
    content: list[OutputBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    type: str = "message"
    role: str = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


# ---------------------------------------------------------------- stream events


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: MessageResponse


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: OutputBlock


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class DeltaUsage(msgspec.Struct):
    output_tokens: int


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass
