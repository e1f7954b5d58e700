"""OpenAI's Responses API (`/v1/responses`) as a translation layer over the chat pipeline.

A create request becomes a `ChatCompletionRequest` (instructions -> system message, input
items -> chat messages, function tools -> chat tools, `text.format` -> response_format) and
runs through `pipeline.start_job` with stream off: same renderer, engine, reasoning and
tool-call parsers. Its frames become output items (`frontend.pipeline.protocol_edge.Blocks`):
`reasoning` (from the reasoning parser), `message` (content) and `function_call` (from the
tool-call parser), in the order the model wrote them, as one JSON body or as the Responses
event stream (response.created, response.output_item.added, response.content_part.added,
response.output_text.delta, ..., response.completed).

Stored responses (`store`, default true) live in the state store (`--state-store`,
frontend.responses.stored), so every frontend on the same store reads them: `GET`, `DELETE`,
`input_items`, `previous_response_id`. `background: true` runs the request with no client
waiting (frontend.responses.background); it is polled, and cancelled, from any frontend.
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.base.api_models import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
)
from frontend.base.errors import APIError, bad_request
from frontend.input.structured import check_tool_names
from frontend.pipeline import pipeline
from frontend.pipeline.input_stage import chat_input
from frontend.pipeline.protocol_edge import (
    Block,
    BlockEvent,
    Blocks,
    Outcome,
    block_events,
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
from frontend.responses import events as event_log
from frontend.responses.background import BackgroundRunner, NoClient
from frontend.responses.conversations import ConversationRecords
from frontend.responses.events import EventLog
from frontend.responses.models import (
    NEUTRAL_VALUES,
    UNSUPPORTED_WHEN_SET,
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ConversationRef,
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    InputItem,
    InputPart,
    InputTokens,
    InputTokensDetails,
    InputTokensRequest,
    LifecycleEvent,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseFormatOut,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamError,
    TextDeltaEvent,
    TextDoneEvent,
    TextOut,
)
from frontend.responses.stored import (
    InputItemList,
    ResponseRecords,
    StoredResponse,
    input_item_dicts,
    list_input_items,
    list_query,
    owner_of,
)
from frontend.state.store import StoreUnavailable
from shared.tool_specs import ChatTool

log = logging.getLogger("sluice.frontend.responses")
_json = msgspec.json.Encoder()
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat fields whose checks (after translation) name them as this API does.
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input",
                "tool_choice.function.name": "tool_choice.name"}


# ---------------------------------------------------------------- the store


class Responses(msgspec.Struct):
    """What the routes share: the records, the background runner, the conversations, the keys
    that own objects."""

    records: ResponseRecords
    runner: BackgroundRunner
    conversations: ConversationRecords
    keys: frozenset[str] = frozenset()  # API keys; where set, each owns what it stores


# ---------------------------------------------------------------- request -> chat request


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


# ---------------------------------------------------------------- frames -> output items


class _Shaper(msgspec.Struct):
    """One response under way: its skeleton, ids and the stream's sequence numbers."""

    base: ResponseObject
    hex: str
    prompt_tokens: int
    seq: int = 0

    def item_id(self, block: Block) -> str:
        prefix = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}[block.kind]
        return f"{prefix}_{self.hex}{block.index}"

    def item(self, block: Block, status: str) -> OutputItem:
        item_id = self.item_id(block)
        if block.kind == "reasoning":
            return ReasoningItem(item_id, status, [ReasoningText(block.text)])
        if block.kind == "text":
            return MessageItem(item_id, status, [OutputText(block.text)])
        return FunctionCallItem(item_id, status, block.call_id, block.name, block.text)

    def final(self, outcome: Outcome) -> ResponseObject:
        last = outcome.last
        items = [self.item(b, "completed") for b in outcome.blocks]
        changes: dict = {}
        if last.finish_reason == "length":
            changes.update(status="incomplete",
                           incomplete_details=IncompleteDetails("max_output_tokens"))
            if items:
                items[-1] = self.item(outcome.blocks[-1], "incomplete")
        elif last.finish_reason == "abort":
            changes.update(status="cancelled")
        else:
            changes.update(status="completed", completed_at=int(time.time()))
        output_tokens = last.num_output_tokens
        usage = ResponseUsage(self.prompt_tokens, output_tokens,
                              self.prompt_tokens + output_tokens,
                              InputTokensDetails(outcome.num_cached_tokens),
                              OutputTokensDetails(last.num_reasoning_tokens or 0))
        return msgspec.structs.replace(self.base, output=items, usage=usage, **changes)

    # ------------------------------------------------------------ stream events

    def event(self, event_type: str, make) -> bytes:
        """`make(type, sequence_number)` builds the event; numbers count from 0."""
        data = _json.encode(make(event_type, self.seq))
        self.seq += 1
        return sse(event_type, data)

    def lifecycle(self, event_type: str, response: ResponseObject) -> bytes:
        return self.event(event_type, lambda t, s: LifecycleEvent(t, s, response))

    def error(self, error: APIError) -> bytes:
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        return self.event("error", lambda t, s: StreamError(s, error.message, code, error.param))

    def block_events(self, ev: BlockEvent, done: str = "completed") -> list[bytes]:
        """A block's open, delta or close as events; `done` is the closed item's status."""
        block = ev.block
        item_id = self.item_id(block)
        out = []

        def emit(event_type: str, make) -> None:
            out.append(self.event(event_type, make))

        text_kind = "output_text" if block.kind == "text" else "reasoning_text"
        part = OutputText if block.kind == "text" else ReasoningText
        logprobs = [] if block.kind == "text" else None
        if ev.what == "open":
            empty = self.item(block, "in_progress")
            if block.kind != "tool_call":
                empty.content = []
            emit("response.output_item.added",
                 lambda t, s: OutputItemEvent(t, s, block.index, empty))
            if block.kind != "tool_call":
                emit("response.content_part.added",
                     lambda t, s: ContentPartEvent(t, s, item_id, block.index, 0, part("")))
        elif ev.what == "delta":
            if block.kind == "tool_call":
                emit("response.function_call_arguments.delta",
                     lambda t, s: ArgumentsDeltaEvent(s, item_id, block.index, ev.delta))
            else:
                emit(f"response.{text_kind}.delta", lambda t, s: TextDeltaEvent(
                    t, s, item_id, block.index, 0, ev.delta, logprobs))
        else:
            if block.kind == "tool_call":
                emit("response.function_call_arguments.done", lambda t, s: ArgumentsDoneEvent(
                    s, item_id, block.index, block.name, block.text))
            else:
                emit(f"response.{text_kind}.done", lambda t, s: TextDoneEvent(
                    t, s, item_id, block.index, 0, block.text, logprobs))
                emit("response.content_part.done",
                     lambda t, s: ContentPartEvent(t, s, item_id, block.index, 0,
                                                   part(block.text)))
            emit("response.output_item.done", lambda t, s: OutputItemEvent(
                t, s, block.index, self.item(block, done)))
        return out


def _answer_message(blocks: list[Block]) -> ChatMessage:
    """The answer as the assistant turn a follow-up's conversation continues from."""
    text = "".join(b.text for b in blocks if b.kind == "text")
    reasoning = "\n".join(b.text for b in blocks if b.kind == "reasoning")
    calls = [{"id": b.call_id, "type": "function",
              "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == "tool_call"]
    # "" rather than null beside tool calls: templates that concatenate content (SmolLM2's)
    # fail on null, and the ones that render calls treat both alike.
    return ChatMessage(role="assistant", content=text,
                       tool_calls=calls or None, reasoning_content=reasoning or None)


def _skeleton(ctx: ServingContext, request: ResponsesRequest, response_id: str) -> ResponseObject:
    fmt = request.text.format if request.text is not None else None
    text = TextOut(ResponseFormatOut(type="text") if fmt is None else ResponseFormatOut(
        type=fmt.type, name=fmt.name, description=fmt.description, schema=fmt.schema,
        strict=fmt.strict))
    return ResponseObject(
        id=response_id, created_at=int(time.time()), model=ctx.model_name,
        status="in_progress", output=[],
        parallel_tool_calls=(True if request.parallel_tool_calls is None
                             else request.parallel_tool_calls),
        tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
        tools=list(request.tools or []), text=text, store=request.store is not False,
        instructions=request.instructions, max_output_tokens=request.max_output_tokens,
        previous_response_id=request.previous_response_id, reasoning=request.reasoning,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        metadata=request.metadata or {}, user=request.user,
        background=bool(request.background),
        conversation=(None if (conv_id := conversation_id(request)) is None
                      else ConversationRef(conv_id)),
    )


# ---------------------------------------------------------------- handlers


async def create(ctx: ServingContext, http: Request, request: ResponsesRequest,
                 responses: Responses) -> Response:
    check_unsupported(request)
    if request.background and request.store is False:
        raise bad_request("a background response must be stored: store false is not allowed "
                          "with background true", "store")
    owner = owner_of(http, responses.keys)
    messages = await conversation(request, responses, owner)
    hex_id = uuid.uuid4().hex
    chat = to_chat(request, messages, request.request_id or hex_id)
    skeleton = _skeleton(ctx, request, f"resp_{hex_id}")
    record = StoredResponse(skeleton, messages, input_item_dicts(request.input, hex_id), owner,
                            hex=hex_id)
    if request.background:
        started = await _create_background(ctx, responses, record, chat)
        if request.stream:  # its events as they are stored: the same a resume replays
            return sse_response(_follow(responses, started, owner, -1))
        return Response(_json.encode(started), media_type="application/json")
    try:
        job, frames = await pipeline.start_job(ctx, http, chat, prefix="resp")
    except APIError as exc:
        raise renamed(exc, _FIELD_NAMES) from exc
    shaper = _Shaper(skeleton, hex_id, job.num_prompt_tokens)

    async def remember(response: ResponseObject, blocks: list[Block]) -> ResponseObject:
        """Stores a finished response (says `store: false` when it was too large to keep),
        and adds its items to its conversation."""
        await _add_to_conversation(responses, record, response)
        if response.store and response.status in ("completed", "incomplete"):
            kept = await responses.records.put(msgspec.structs.replace(
                record, response=response, conversation=[*messages, _answer_message(blocks)]))
            if not kept:
                return msgspec.structs.replace(response, store=False)
        return response

    if request.stream:
        return sse_response(_stream(shaper, frames, remember))
    outcome = await gather(frames)
    if not outcome.finished:
        return Response(status_code=499)  # the client left; nobody reads this
    response = await remember(shaper.final(outcome), outcome.blocks)
    return Response(_json.encode(response), media_type="application/json")


async def _add_to_conversation(responses: Responses, record: StoredResponse,
                               response: ResponseObject) -> None:
    """A finished response's input and output items join its conversation. The answer is
    made by then, so a conversation deleted meanwhile (404) or grown past what the store
    keeps (413) only goes without them; a store that is away is the caller's 503."""
    if response.conversation is None or response.status not in ("completed", "incomplete"):
        return
    items = [*record.input_items, *(msgspec.to_builtins(item) for item in response.output)]
    try:
        async with responses.conversations.changing(response.conversation.id,
                                                    record.owner) as conv:
            conv.items.extend(items)
    except StoreUnavailable:
        raise
    except APIError as exc:
        log.warning("response %s not added to conversation %s: %s", response.id,
                    response.conversation.id, exc.message)


async def _create_background(ctx: ServingContext, responses: Responses, record: StoredResponse,
                             chat: ChatCompletionRequest) -> ResponseObject:
    """Stores the response in_progress (so any frontend sees it), takes its lease and runs
    it here; a request the checks refuse is a 4xx now, and nothing stays stored."""
    records, response_id = responses.records, record.response.id
    record = msgspec.structs.replace(record, chat=chat)
    if not await records.put(record):
        raise APIError(413, "the request is larger than the state store keeps", "input")
    await records.lease(response_id, responses.runner.holder)
    await records.mark_unfinished(record)  # after the lease: a sweep finds it held
    try:
        await _run_background(ctx, responses, record)
    except APIError:
        await records.delete(response_id, record.owner)
        await records.finished(response_id)
        raise
    return record.response


async def _run_background(ctx: ServingContext, responses: Responses, record: StoredResponse
                          ) -> None:
    try:
        job, frames = await pipeline.start_job(ctx, NoClient(), record.chat, prefix="resp")
    except APIError as exc:
        raise renamed(exc, _FIELD_NAMES) from exc
    shaper = _Shaper(record.response, record.hex, job.num_prompt_tokens)
    records = responses.records
    kept = EventLog(records.store, record.response.id, records.ttl_s,
                    records.store.max_value_bytes)
    blocks = Blocks()

    async def run() -> Outcome:
        """The answer, its events stored as they are made (for streams and resumes)."""
        try:
            async with aclosing(_events(shaper, frames, blocks)) as events:
                async for event in events:
                    kept.add(event)
                    await kept.flush(force=len(kept.events) <= 2)  # response.created at once
        except APIError as error:
            kept.add(shaper.error(error))
            raise
        return blocks.outcome()

    def finish(outcome: Outcome | None, error: APIError | None) -> StoredResponse:
        if error is not None:
            response = _failed(shaper, error, blocks)
            kept.add(shaper.lifecycle("response.failed", response))
            return msgspec.structs.replace(record, response=response, chat=None)
        response = shaper.final(outcome)
        if response.status in ("completed", "incomplete"):
            kept.add(shaper.lifecycle(f"response.{response.status}", response))
        return msgspec.structs.replace(
            record, response=response, chat=None,
            conversation=[*record.conversation, _answer_message(outcome.blocks)])

    async def done(stored: StoredResponse) -> None:
        try:
            await _add_to_conversation(responses, stored, stored.response)
        finally:  # the final event last: a follower then finds the rest done
            await kept.flush(force=True)

    responses.runner.start(record.response.id, run(), finish, done)


async def _resume(ctx: ServingContext, responses: Responses, stored: StoredResponse) -> None:
    """Runs a background response again whose runner died; a refusal now marks it failed."""
    # A new engine request id: the dead frontend's request may still be in the engine.
    chat = msgspec.structs.replace(stored.chat, request_id=uuid.uuid4().hex)
    # Its events start again from 0: none of the first run's may outlast the new ones.
    await event_log.forget(responses.records.store, stored.response.id)
    try:
        await _run_background(ctx, responses, msgspec.structs.replace(stored, chat=chat))
    except APIError as error:
        failed = msgspec.structs.replace(stored.response, status="failed",
                                         error=ResponseError("server_error", error.message))
        await responses.records.put(msgspec.structs.replace(stored, response=failed, chat=None))
        await responses.records.finished(stored.response.id)


async def sweep(ctx: ServingContext, responses: Responses) -> None:
    """This frontend's share of running background responses whose frontend died."""
    await responses.runner.sweep(lambda stored: _resume(ctx, responses, stored))


def _failed(shaper: _Shaper, error: APIError, blocks: Blocks) -> ResponseObject:
    code = "server_error" if error.status >= 500 else "invalid_prompt"
    return msgspec.structs.replace(
        shaper.base, status="failed", error=ResponseError(code, error.message),
        output=[shaper.item(b, "incomplete") for b in blocks.blocks])


async def _events(shaper: _Shaper, frames, blocks: Blocks):
    """The stream's events up to the final one (the caller's, once the response is final):
    response.created, in_progress, then each item's. An error frame raises its APIError."""
    yield shaper.lifecycle("response.created", shaper.base)
    yield shaper.lifecycle("response.in_progress", shaper.base)
    async with aclosing(block_events(frames, blocks)) as events:
        async for ev in events:
            for chunk in shaper.block_events(ev):
                yield chunk
    outcome = blocks.outcome()
    if not outcome.finished:
        return  # the client left
    # The last block is cut short when the token limit ended the answer.
    done = "incomplete" if outcome.last.finish_reason == "length" else "completed"
    for ev in blocks.finish():
        for chunk in shaper.block_events(ev, done):
            yield chunk


async def _stream(shaper: _Shaper, frames, remember):
    blocks = Blocks()
    try:
        async with aclosing(_events(shaper, frames, blocks)) as events:
            async for chunk in events:
                yield chunk
    except APIError as error:
        yield shaper.error(error)
        yield shaper.lifecycle("response.failed", _failed(shaper, error, blocks))
        return
    outcome = blocks.outcome()
    if not outcome.finished:
        return  # the client left
    response = shaper.final(outcome)
    try:
        response = await remember(response, outcome.blocks)
    except StoreUnavailable:  # the answer is out; the final event says it was not kept
        response = msgspec.structs.replace(response, store=False)
    final = "response.incomplete" if response.status == "incomplete" else "response.completed"
    yield shaper.lifecycle(final, response)


async def retrieve(ctx: ServingContext, http: Request, responses: Responses,
                   response_id: str) -> ResponseObject:
    stored = await responses.records.find(response_id, owner_of(http, responses.keys))
    if stored.chat is not None:  # background, unfinished: is anyone still running it?
        await responses.runner.take_over_if_lapsed(
            stored, lambda: _resume(ctx, responses, stored))
    return stored.response


async def delete(http: Request, responses: Responses, response_id: str) -> DeletedResponse:
    await responses.records.delete(response_id, owner_of(http, responses.keys))
    await responses.records.ask_cancel(response_id)  # a background run stops too
    await event_log.forget(responses.records.store, response_id)
    return DeletedResponse(response_id)


def stream_query(http: Request) -> tuple[bool, int]:
    """`GET /v1/responses/{id}`'s `stream` and `starting_after` (-1 when not given)."""
    query = http.query_params
    stream = query.get("stream", "false").lower()
    if stream not in ("true", "false", "1", "0"):
        raise bad_request("stream must be true or false", "stream")
    if "starting_after" not in query:
        return stream in ("true", "1"), -1
    if stream not in ("true", "1"):
        raise bad_request("starting_after is only allowed when stream is true",
                          "starting_after")
    try:
        after = int(query["starting_after"])
    except ValueError:
        raise bad_request("starting_after must be an integer", "starting_after") from None
    if after < 0:
        raise bad_request("starting_after must be 0 or more", "starting_after")
    return True, after


async def resume_stream(ctx: ServingContext, http: Request, responses: Responses,
                        response_id: str, after: int) -> Response:
    """A background response's events after `after`, stored and then live, as OpenAI's
    `GET /v1/responses/{id}?stream=true&starting_after=N`."""
    owner = owner_of(http, responses.keys)
    stored = await responses.records.find(response_id, owner)
    if not stored.response.background:
        raise bad_request("This response cannot be streamed because it was not created with "
                          "background=true.", "stream")
    kept = await event_log.count(responses.records.store, response_id)
    if after >= kept:
        last = f"its last is {kept - 1}" if kept else "none are stored"
        raise bad_request(f"starting_after {after} is past this response's events "
                          f"({last})", "starting_after")
    if stored.chat is not None:  # unfinished: is anyone still running it?
        await responses.runner.take_over_if_lapsed(
            stored, lambda: _resume(ctx, responses, stored))
    return sse_response(_follow(responses, stored.response, owner, after, ctx))


def _follow(responses: Responses, response: ResponseObject, owner: str, after: int,
            ctx: ServingContext | None = None):
    """The stored events after `after`, then the live ones until the response ends; with
    `ctx`, a follower whose response's runner died takes it over, as a poll would."""
    async def finished() -> bool:
        stored = await responses.records.get(response.id, owner)
        if stored is not None and stored.chat is not None and ctx is not None:
            await responses.runner.take_over_if_lapsed(
                stored, lambda: _resume(ctx, responses, stored))
        return stored is None or stored.response.status not in ("queued", "in_progress")

    return event_log.follow(responses.records.store, response.id, after, finished)


async def cancel(http: Request, responses: Responses, response_id: str) -> ResponseObject:
    """Cancels a background response from any frontend: the record says cancelled at once,
    and its runner, seeing the cancel asked, aborts the engine request."""
    records = responses.records
    stored = await records.find(response_id, owner_of(http, responses.keys))
    if not stored.response.background:
        raise bad_request("Only responses created with background=true can be cancelled.")
    if stored.response.status in ("queued", "in_progress"):
        await records.ask_cancel(response_id)
        stored = msgspec.structs.replace(stored, chat=None, response=msgspec.structs.replace(
            stored.response, status="cancelled"))
        await records.put(stored)
        await records.finished(response_id)
    return stored.response


async def input_items(http: Request, responses: Responses, response_id: str
                      ) -> InputItemList:
    stored = await responses.records.find(response_id, owner_of(http, responses.keys))
    return list_input_items(stored, *list_query(http))


async def input_tokens(ctx: ServingContext, http: Request, request: InputTokensRequest,
                       responses: Responses) -> InputTokens:
    """What the create request's prompt would be, in tokens: rendered and tokenized as it."""
    messages = await conversation(request, responses, owner_of(http, responses.keys))
    chat = to_chat(ResponsesRequest(
        model=request.model, instructions=request.instructions, tools=request.tools,
        tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls,
        text=request.text), messages, uuid.uuid4().hex)
    check_model(ctx, chat.model)
    try:
        check_request(chat, structured_settings(ctx), ctx.limits)
    except APIError as exc:
        raise renamed(exc, _FIELD_NAMES) from exc
    prompt = await chat_input(ctx, chat)
    return InputTokens(prompt.num_tokens)
