"""A Responses request as a chat request: instructions -> system message, input items ->
chat messages (after the earlier turns of `previous_response_id` or the conversation),
function tools -> chat tools, `text.format` -> response_format; and the fields this server
refuses."""

from __future__ import annotations

import msgspec

from frontend.base.api_models import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
)
from frontend.base.errors import bad_request
from frontend.input.structured import check_tool_names
from frontend.pipeline.protocol_edge import function_tool
from frontend.responses.models import (
    NEUTRAL_VALUES,
    UNSUPPORTED_WHEN_SET,
    InputItem,
    InputPart,
    InputTokensRequest,
    ResponsesRequest,
)
from frontend.responses.shared import Responses
from shared.tool_specs import ChatTool

_LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat fields whose checks (after translation) name them as this API does.
FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input",
               "tool_choice.function.name": "tool_choice.name"}


def check_unsupported(request: ResponsesRequest) -> None:
    for field, default in UNSUPPORTED_WHEN_SET:
        value = getattr(request, field)
        if value != default and value not in NEUTRAL_VALUES.get(field, ()):
            raise bad_request(f"'{field}' is not supported by this server", field)
    if request.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: an input that does not fit is "
                          "a 400; drop earlier items yourself", "truncation")
    if request.top_logprobs or _LOGPROBS_INCLUDE in (request.include or ()):
        raise bad_request("logprobs are not supported on /v1/responses; use "
                          "/v1/chat/completions", "top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def _part_text(part: InputPart, param: str) -> str:
    if part.type in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
        return part.text or ""
    if part.type == "refusal":
        return part.refusal or ""
    raise bad_request(f"content of type {part.type!r} is not supported (text only)", param)


def _text(content: str | list[InputPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(_part_text(p, param) for p in content)


def _input_content(content: str | list[InputPart] | None, param: str
                   ) -> str | list[ContentPart]:
    """A user or system message's content: its text, or with input_image parts the parts
    in order, as chat image_url parts (frontend.input.multimodal takes them from there)."""
    if not isinstance(content, list) or all(p.type != "input_image" for p in content):
        return _text(content, param)
    parts = []
    for i, part in enumerate(content):
        if part.type != "input_image":
            parts.append(ContentPart(type="text", text=_part_text(part, param)))
        elif part.image_url is None:
            raise bad_request("input_image needs image_url (file_id is not supported)",
                              f"{param}[{i}].image_url")
        else:
            parts.append(ContentPart(type="image_url", image_url={
                "url": part.image_url, "detail": part.detail or "auto"}))
    return parts


def input_messages(items: str | list[InputItem] | None) -> list[ChatMessage]:
    """Input items -> chat messages. A function_call joins the assistant message before it
    (or starts one); a reasoning item goes with the assistant message that follows it."""
    if items is None:
        return []
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    reasoning: list[str] = []

    def assistant() -> ChatMessage:
        if out and out[-1].role == "assistant" and not reasoning:
            return out[-1]
        message = ChatMessage(role="assistant", content="",
                              reasoning_content="\n".join(reasoning) or None)
        reasoning.clear()
        out.append(message)
        return message

    for i, item in enumerate(items):
        param = f"input[{i}]"
        if item.type == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"unknown message role {item.role!r}", param + ".role")
            if item.role == "assistant":
                message = assistant()
                message.content = (message.content or "") + _text(item.content,
                                                                  param + ".content")
            else:
                out.append(ChatMessage(role=item.role,
                                       content=_input_content(item.content, param + ".content")))
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                raise bad_request("a function_call item needs call_id and name", param)
            message = assistant()
            message.tool_calls = [*(message.tool_calls or []), {
                "id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"}}]
        elif item.type == "function_call_output":
            if not item.call_id:
                raise bad_request("a function_call_output item needs call_id", param)
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_text(item.output, param + ".output")))
        elif item.type == "reasoning":
            parts = item.content if isinstance(item.content, list) else item.summary or []
            reasoning.append("\n".join(_part_text(p, param) for p in parts))
        else:
            raise bad_request(f"input items of type {item.type!r} are not supported", param)
    return out


def chat_tools(request: ResponsesRequest | InputTokensRequest) -> list[ChatTool] | None:
    if not request.tools:
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.type != "function":
            raise bad_request(f"tools of type {tool.type!r} are not supported (function "
                              "tools only)", f"tools[{i}].type")
        if tool.name is None:
            raise bad_request("a function tool needs a name", f"tools[{i}].name")
        tools.append(function_tool(tool.name, tool.parameters, tool.description, tool.strict))
    check_tool_names([t.function.name for t in tools], "tools[{}].name")
    return tools


def chat_tool_choice(choice) -> str | NamedToolChoice | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("a function tool_choice needs a name", "tool_choice.name")
        return NamedToolChoice(type="function", function=NamedFunction(name))
    raise bad_request('tool_choice must be "none", "auto", "required" or '
                      '{"type": "function", "name": ...}', "tool_choice")


def chat_response_format(request: ResponsesRequest | InputTokensRequest
                         ) -> ResponseFormat | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict))


def conversation_id(request: ResponsesRequest | InputTokensRequest) -> str | None:
    """The `conversation` the request continues (a string id or `{"id": ...}`), if any."""
    given = request.conversation
    if given is None:
        return None
    if request.previous_response_id is not None:
        raise bad_request("Mutually exclusive parameters: Ensure you are only providing one "
                          "of: 'previous_response_id' or 'conversation'.", "conversation")
    return given if isinstance(given, str) else given.id


async def conversation(request: ResponsesRequest | InputTokensRequest, responses: Responses,
                       owner: str) -> list[ChatMessage]:
    """The earlier turns (previous_response_id's, or the conversation's items) and this
    request's input, as chat messages."""
    history: list[ChatMessage] = []
    conv_id = conversation_id(request)  # first: with previous_response_id, a 400
    if request.previous_response_id is not None:
        stored = await responses.records.find(request.previous_response_id, owner,
                                              "previous_response_id")
        history = list(stored.conversation)
    if conv_id is not None:
        record = await responses.conversations.find(conv_id, owner, "conversation")
        if isinstance(request, ResponsesRequest):  # room for its input and an answer
            given = len(_as_items(request.input))
            responses.conversations.check_room(record, given + 1, "conversation")
        # The stored items were checked when added; the request's keep their own numbers.
        history = input_messages([msgspec.convert(item, InputItem) for item in record.items])
    return history + input_messages(request.input)


def _as_items(given: str | list[InputItem] | None) -> list[InputItem]:
    if given is None:
        return []
    return [InputItem(role="user", content=given)] if isinstance(given, str) else given


def to_chat(request: ResponsesRequest, messages: list[ChatMessage], request_id: str
            ) -> ChatCompletionRequest:
    if request.instructions:
        messages = [ChatMessage(role="system", content=request.instructions), *messages]
    if not messages:
        raise bad_request("input must not be empty", "input")
    prefill = request.continue_final_message
    return ChatCompletionRequest(
        messages=messages,
        model=request.model,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=chat_tools(request),
        # "auto" is this API's default, so it is fine without tools (chat's is not).
        tool_choice=(None if request.tool_choice == "auto" and not request.tools
                     else chat_tool_choice(request.tool_choice)),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=chat_response_format(request),
        stream=False,  # the chat pipeline writes no chunk bytes; we shape the frames here
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        seed=request.seed,
        stop=request.stop,
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        request_id=request_id,
        cache_salt=request.cache_salt,
        priority=request.priority,
        chat_template_kwargs=request.chat_template_kwargs,
        reasoning_effort=request.reasoning.effort if request.reasoning else None,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
    )
