"""Anthropic's Messages API (`/v1/messages`) as a translation layer over the chat pipeline.

A Messages request becomes a `ChatCompletionRequest` (system prompt -> system message, content
blocks -> chat messages with tool calls and tool results, tools and tool_choice, thinking ->
the template's thinking switches, stop_sequences -> stop, output_config.format ->
response_format) and runs through `pipeline.start_job` with stream off: same renderer, engine,
reasoning and tool-call parsers. The frames become content blocks
(`frontend.pipeline.protocol_edge.Blocks`): `thinking` (from the reasoning parser), `text` and
`tool_use` (from the tool-call parser), as one JSON body or as Anthropic's event stream
(message_start, content_block_start / content_block_delta / content_block_stop per block,
message_delta, message_stop). Errors use Anthropic's shape (`frontend.base.errors`).

As in Anthropic's API, a last message from the assistant is a prefill: the answer continues it.
"""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.anthropic.models import (
    UNSUPPORTED_WHEN_SET,
    ContentBlock,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    DeltaUsage,
    InputJsonDelta,
    MessageDelta,
    MessageResponse,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutputBlock,
    StopDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    TokenCount,
    ToolUseBlock,
    Usage,
)
from frontend.base.api_models import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
)
from frontend.base.errors import APIError, anthropic_error_body, bad_request
from frontend.input.structured import check_tool_names
from frontend.pipeline import pipeline
from frontend.pipeline.input_stage import chat_input
from frontend.pipeline.protocol_edge import (
    Block,
    BlockEvent,
    Blocks,
    Outcome,
    block_events,
    call_arguments,
    function_tool,
    gather,
    renamed,
    sse,
)
from frontend.pipeline.sampling import check_request
from frontend.pipeline.serving_context import (
    ServingContext,
    check_model,
    sse_response,
    structured_settings,
)
from shared.protocol import TextFrame
from shared.tool_specs import ChatTool

_json = msgspec.json.Encoder()
# Chat fields whose checks (after translation) name them as this API does.
_FIELD_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                "tool_choice.function.name": "tool_choice.name"}


# ---------------------------------------------------------------- request -> chat request


def _block_text(block: ContentBlock, param: str) -> str:
    if block.type != "text":
        raise bad_request(f"content blocks of type {block.type!r} are not supported here "
                          "(text only)", param)
    return block.text or ""


def _texts(content: str | list[ContentBlock] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(_block_text(b, f"{param}[{i}]") for i, b in enumerate(content))


def _image_url(block: ContentBlock, param: str) -> str:
    """An image block's source as a URL the media loader reads (a base64 one as data:)."""
    source = block.source if isinstance(block.source, dict) else {}
    if source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise bad_request("a base64 image source needs media_type and data",
                              param + ".source")
        return f"data:{media_type};base64,{data}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request("an image block needs a source of type base64 or url", param + ".source")


def _user_content(parts: list[ContentPart]) -> str | list[ContentPart]:
    """Text only: one string, as before images; with images, the parts in order."""
    if all(p.type == "text" for p in parts):
        return "\n".join(p.text or "" for p in parts)
    return parts


def _user(blocks: list[ContentBlock], param: str) -> list[ChatMessage]:
    """A user turn's blocks: its tool results (one tool message each), then its text and
    images (as OpenAI image_url parts, in order)."""
    out: list[ChatMessage] = []
    texts: list[ContentPart] = []
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        if block.type == "tool_result":
            if not block.tool_use_id:
                raise bad_request("a tool_result block needs tool_use_id", where)
            result = _texts(block.content, where + ".content")
            if block.is_error:
                result = f"Error: {result}"
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=result))
        elif block.type == "image":
            texts.append(ContentPart(type="image_url",
                                     image_url={"url": _image_url(block, where)}))
        else:
            texts.append(ContentPart(type="text", text=_block_text(block, where)))
    if texts:
        out.append(ChatMessage(role="user", content=_user_content(texts)))
    return out


def _assistant(blocks: list[ContentBlock], param: str) -> ChatMessage:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict] = []
    for i, block in enumerate(blocks):
        where = f"{param}[{i}]"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thinking.append(block.thinking or "")
        elif block.type == "redacted_thinking":
            continue  # opaque to us
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise bad_request("a tool_use block needs id and name", where)
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input or {})}})
        else:
            raise bad_request(f"content blocks of type {block.type!r} are not supported in "
                              "assistant messages", where)
    text = "".join(texts)
    # "" rather than null beside tool calls: templates that concatenate content (SmolLM2's)
    # fail on null, and the ones that render calls treat both alike.
    return ChatMessage(role="assistant", content=text,
                       tool_calls=calls or None, reasoning_content="\n".join(thinking) or None)


def chat_messages(request: MessagesRequest | CountTokensRequest) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if request.system is not None:
        system = _texts(request.system, "system")
        if system:
            out.append(ChatMessage(role="system", content=system))
    for i, message in enumerate(request.messages):
        param = f"messages[{i}].content"
        if message.role == "system":
            out.append(ChatMessage(role="system", content=_texts(message.content, param)))
        elif isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "user":
            out.extend(_user(message.content, param))
        else:
            out.append(_assistant(message.content, param))
    if not out or all(m.role == "system" for m in out):
        raise bad_request("messages must not be empty", "messages")
    return out


def _tools(request: MessagesRequest | CountTokensRequest) -> list[ChatTool] | None:
    if not request.tools:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.type not in (None, "custom"):
            raise bad_request(f"tools[{i}].type: server tools ({tool.type!r}) are not "
                              "supported; client tools only", f"tools[{i}].type")
        tools.append(function_tool(tool.name, tool.input_schema, tool.description, tool.strict))
    check_tool_names([t.function.name for t in tools], "tools[{}].name")
    return tools


def _tool_choice(request: MessagesRequest | CountTokensRequest):
    choice = request.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs a name", "tool_choice.name")
        return NamedToolChoice(type="function", function=NamedFunction(choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _response_format(request: MessagesRequest | CountTokensRequest) -> ResponseFormat | None:
    fmt = request.output_format
    if request.output_config is not None and request.output_config.format is not None:
        fmt = request.output_config.format
    if fmt is None:
        return None
    return ResponseFormat(type="json_schema",
                          json_schema=JsonSchemaFormat(name="output", schema=fmt.schema))


def _template_kwargs(request: MessagesRequest | CountTokensRequest) -> dict | None:
    """Thinking on or off, written as both switches templates use (req O-5)."""
    if request.thinking is None:
        return None
    on = request.thinking.type != "disabled"
    return {"enable_thinking": on, "thinking": on}


def check_unsupported(request: MessagesRequest | CountTokensRequest) -> None:
    for field in UNSUPPORTED_WHEN_SET:
        if getattr(request, field) is not None:
            raise bad_request(f"'{field}' is not supported by this server", field)


def to_chat(request: MessagesRequest | CountTokensRequest, request_id: str
            ) -> ChatCompletionRequest:
    check_unsupported(request)
    messages = chat_messages(request)
    # A last assistant message is a prefill: the answer continues it (Anthropic's rule).
    prefill = messages[-1].role == "assistant" and not messages[-1].tool_calls
    choice = request.tool_choice
    sampling = {}
    if isinstance(request, MessagesRequest):
        if request.max_tokens < 1:
            raise bad_request("max_tokens must be at least 1", "max_tokens")
        sampling = dict(max_completion_tokens=request.max_tokens, stop=request.stop_sequences,
                        temperature=request.temperature, top_p=request.top_p,
                        top_k=request.top_k)
    return ChatCompletionRequest(
        messages=messages,
        model=request.model,
        tools=_tools(request),
        tool_choice=_tool_choice(request),
        parallel_tool_calls=(False if choice is not None and choice.disable_parallel_tool_use
                             else None),
        response_format=_response_format(request),
        chat_template_kwargs=_template_kwargs(request),
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        stream=False,  # the chat pipeline writes no chunk bytes; we shape the frames here
        request_id=request_id,
        **sampling,
    )


# ---------------------------------------------------------------- frames -> content blocks


def _content(block: Block) -> OutputBlock:
    if block.kind == "reasoning":
        return ThinkingBlock(block.text)
    if block.kind == "text":
        return TextBlock(block.text)
    return ToolUseBlock(block.call_id, block.name, call_arguments(block))


def stop_reason(request: MessagesRequest, last: TextFrame) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words."""
    if last.finish_reason == "tool_calls":
        return "tool_use", None
    if last.finish_reason == "length":
        return "max_tokens", None
    if isinstance(last.stop_reason, str) and last.stop_reason in (request.stop_sequences or ()):
        return "stop_sequence", last.stop_reason
    return "end_turn", None


def _message(ctx: ServingContext, request: MessagesRequest, message_id: str, prompt_tokens: int,
             outcome: Outcome) -> MessageResponse:
    reason, sequence = stop_reason(request, outcome.last)
    return MessageResponse(message_id, ctx.model_name, [_content(b) for b in outcome.blocks],
                           reason, sequence,
                           Usage(prompt_tokens, outcome.last.num_output_tokens))


# ---------------------------------------------------------------- handlers


async def create(ctx: ServingContext, http: Request, request: MessagesRequest) -> Response:
    # vLLM's X-Request-Id names the request here too (the body has no request_id field).
    hex_id = http.headers.get("x-request-id") or uuid.uuid4().hex
    chat = to_chat(request, hex_id)
    try:
        job, frames = await pipeline.start_job(ctx, http, chat, prefix="msg")
    except APIError as exc:
        raise renamed(exc, _FIELD_NAMES) from exc
    message_id = f"msg_{hex_id}"
    if request.stream:
        events = _stream(ctx, request, message_id, job.num_prompt_tokens, frames)
        return sse_response(events)
    outcome = await gather(frames)
    if not outcome.finished:
        return Response(status_code=499)  # the client left; nobody reads this
    body = _message(ctx, request, message_id, job.num_prompt_tokens, outcome)
    return Response(_json.encode(body), media_type="application/json")


def _event(struct) -> bytes:
    return sse(struct.__struct_config__.tag, _json.encode(struct))


def _block_event(ev: BlockEvent) -> bytes:
    block = ev.block
    if ev.what == "open":
        start = {"reasoning": lambda: ThinkingBlock(""), "text": lambda: TextBlock(""),
                 "tool_call": lambda: ToolUseBlock(block.call_id, block.name, {})}
        return _event(ContentBlockStart(block.index, start[block.kind]()))
    if ev.what == "delta":
        delta = {"reasoning": ThinkingDelta, "text": TextDelta,
                 "tool_call": InputJsonDelta}[block.kind](ev.delta)
        return _event(ContentBlockDelta(block.index, delta))
    return _event(ContentBlockStop(block.index))


async def _stream(ctx: ServingContext, request: MessagesRequest, message_id: str,
                  prompt_tokens: int, frames):
    start = MessageResponse(message_id, ctx.model_name, [], None, None, Usage(prompt_tokens, 0))
    yield _event(MessageStart(start))
    blocks = Blocks()
    try:
        async with aclosing(block_events(frames, blocks)) as events:
            async for ev in events:
                yield _block_event(ev)
    except APIError as error:
        yield sse("error", _json.encode(anthropic_error_body(error.status, error.message)))
        return
    outcome = blocks.outcome()
    if not outcome.finished:
        return  # the client left
    for ev in blocks.finish():
        yield _block_event(ev)
    reason, sequence = stop_reason(request, outcome.last)
    yield _event(MessageDelta(StopDelta(reason, sequence),
                              DeltaUsage(outcome.last.num_output_tokens)))
    yield _event(MessageStop())


async def count_tokens(ctx: ServingContext, request: CountTokensRequest) -> TokenCount:
    chat = to_chat(request, uuid.uuid4().hex)
    check_model(ctx, chat.model)
    check_request(chat, structured_settings(ctx), ctx.limits)
    prompt = await chat_input(ctx, chat)
    return TokenCount(prompt.usage_tokens)  # what usage would say

