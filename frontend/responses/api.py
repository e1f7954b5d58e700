"""OpenAI's Responses API (`/v1/responses`) as a translation layer over the chat pipeline:
the handlers (create, retrieve, delete, cancel, input items, input tokens, resumed streams).

A create request becomes a `ChatCompletionRequest` (`chat_request.py`: instructions ->
system message, input items -> chat messages, function tools -> chat tools, `text.format` ->
response_format) and runs through `pipeline.start_job` with stream off: same renderer,
engine, reasoning and tool-call parsers. Its frames become output items
(`frontend.pipeline.protocol_edge.Blocks`, shaped in `shaping.py`): `reasoning` (from the
reasoning parser), `message` (content) and `function_call` (from the tool-call parser), in
the order the model wrote them, as one JSON body or as the Responses event stream
(`event_stream.py`: response.created, response.output_item.added,
response.content_part.added, response.output_text.delta, ..., response.completed).

Stored responses (`store`, default true) live in the state store (`--state-store`,
frontend.responses.stored), so every frontend on the same store reads them: `GET`, `DELETE`,
`input_items`, `previous_response_id`. `background: true` runs the request with no client
waiting (`background_runs.py`, under frontend.responses.background's lease); it is polled,
and cancelled, from any frontend.
"""

from __future__ import annotations

import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.base.errors import APIError, bad_request
from frontend.pipeline import pipeline
from frontend.pipeline.input_stage import chat_input
from frontend.pipeline.protocol_edge import Block, gather, renamed
from frontend.pipeline.sampling import check_request
from frontend.pipeline.serving_context import (
    ServingContext,
    check_model,
    sse_response,
    structured_settings,
)
from frontend.responses import events as event_log
from frontend.responses.background_runs import follow, resume, start_background
from frontend.responses.chat_request import FIELD_NAMES, check_unsupported, conversation, to_chat
from frontend.responses.event_stream import stream_events
from frontend.responses.models import (
    DeletedResponse,
    InputTokens,
    InputTokensRequest,
    ResponseObject,
    ResponsesRequest,
)
from frontend.responses.shaping import Shaper, answer_message, response_skeleton
from frontend.responses.shared import Responses, add_to_conversation
from frontend.responses.stored import (
    InputItemList,
    StoredResponse,
    input_item_dicts,
    list_input_items,
    list_query,
    owner_of,
)

_json = msgspec.json.Encoder()


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
    skeleton = response_skeleton(ctx, request, f"resp_{hex_id}")
    record = StoredResponse(skeleton, messages, input_item_dicts(request.input, hex_id), owner,
                            hex=hex_id)
    if request.background:
        started = await start_background(ctx, responses, record, chat)
        if request.stream:  # its events as they are stored: the same a resume replays
            return sse_response(follow(responses, started, owner, -1))
        return Response(_json.encode(started), media_type="application/json")
    try:
        job, frames = await pipeline.start_job(ctx, http, chat, prefix="resp")
    except APIError as exc:
        raise renamed(exc, FIELD_NAMES) from exc
    shaper = Shaper(skeleton, hex_id, job.num_prompt_tokens)

    async def remember(response: ResponseObject, blocks: list[Block]) -> ResponseObject:
        """Stores a finished response (says `store: false` when it was too large to keep),
        and adds its items to its conversation."""
        await add_to_conversation(responses, record, response)
        if response.store and response.status in ("completed", "incomplete"):
            kept = await responses.records.put(msgspec.structs.replace(
                record, response=response, conversation=[*messages, answer_message(blocks)]))
            if not kept:
                return msgspec.structs.replace(response, store=False)
        return response

    if request.stream:
        return sse_response(stream_events(shaper, frames, remember))
    outcome = await gather(frames)
    if not outcome.finished:
        return Response(status_code=499)  # the client left; nobody reads this
    response = await remember(shaper.final(outcome), outcome.blocks)
    return Response(_json.encode(response), media_type="application/json")


async def retrieve(ctx: ServingContext, http: Request, responses: Responses,
                   response_id: str) -> ResponseObject:
    stored = await responses.records.find(response_id, owner_of(http, responses.keys))
    if stored.chat is not None:  # background, unfinished: is anyone still running it?
        await responses.runner.take_over_if_lapsed(
            stored, lambda: resume(ctx, responses, stored))
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
            stored, lambda: resume(ctx, responses, stored))
    return sse_response(follow(responses, stored.response, owner, after, ctx))


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
        raise renamed(exc, FIELD_NAMES) from exc
    prompt = await chat_input(ctx, chat)
    return InputTokens(prompt.usage_tokens)  # what usage would say
