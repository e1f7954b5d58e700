"""From a parsed request to an HTTP response: input stage, engine submission, output shaping.

Route handlers stay thin; this module turns the engine's text frames into OpenAI bodies and
SSE chunks, streaming or not, and makes sure every accepted request ends with a response or
an error and, if the client leaves, an abort that frees its pages.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from frontend.api_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    Usage,
)
from frontend.engine_client import EngineClient, EngineUnavailable
from frontend.errors import APIError, bad_request, error_body
from frontend.input_stage import chat_prompt_ids, completion_prompt_ids
from frontend.sampling import reject_unsupported, to_sampling_params
from frontend.tokenization import Tokenization
from shared.protocol import EngineRequest, TextFrame, pack_ids

_json = msgspec.json.Encoder()
_DISCONNECTED = object()  # queue sentinel: the client went away


class ServingContext(msgspec.Struct):
    client: EngineClient
    tokenization: Tokenization
    model_name: str
    vocab_size: int


class PreparedRequest(msgspec.Struct):
    request_id: str
    prompt_ids: list[int]
    engine_request: EngineRequest
    created: int


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model '{model}' does not exist.", "model")


def max_model_len(ctx: ServingContext) -> int:
    if ctx.client.stats is None or not ctx.client.engine_alive:
        raise APIError(503, "The engine is not available; try again shortly.")
    return ctx.client.stats.max_model_len


# ---------------------------------------------------------------- engine request


async def prepare(
    ctx: ServingContext,
    request: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    endpoint: str,
    prefix: str,
) -> PreparedRequest:
    params = to_sampling_params(
        request, endpoint=endpoint, prompt_len=len(prompt_ids), max_model_len=max_model_len(ctx)
    )
    request_id = f"{prefix}-{request.request_id or uuid.uuid4().hex}"
    engine_request = EngineRequest(
        request_id=request_id,
        prompt_token_ids=pack_ids(prompt_ids),
        params=params,
        reply_to=ctx.client.result_address,
        arrival_time=time.time(),
        skip_special_tokens=request.skip_special_tokens,
    )
    return PreparedRequest(request_id, prompt_ids, engine_request, int(time.time()))


# ---------------------------------------------------------------- engine round trip


async def _submit(ctx: ServingContext, prepared: PreparedRequest) -> asyncio.Queue:
    try:
        return await ctx.client.submit(
            prepared.engine_request,
            prepared.prompt_ids,
            prepared.engine_request.skip_special_tokens,
        )
    except EngineUnavailable as exc:
        raise APIError(503, str(exc)) from exc


async def _watch_disconnect(http: Request, queue: asyncio.Queue) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(_DISCONNECTED)
            return


async def _frames(
    ctx: ServingContext, http: Request, prepared: PreparedRequest, queue: asyncio.Queue
) -> AsyncIterator[TextFrame]:
    """The request's frames until it finishes; aborts it if the client leaves first."""
    watcher = asyncio.create_task(_watch_disconnect(http, queue))
    finished = False
    try:
        while True:
            frame = await queue.get()
            if frame is _DISCONNECTED:
                return
            yield frame
            if frame.finish_reason is not None:
                finished = True
                return
    finally:
        watcher.cancel()
        if not finished:
            await ctx.client.abort(prepared.request_id)
        ctx.client.release(prepared.request_id)


def _usage(frame: TextFrame) -> Usage:
    return Usage(
        frame.num_prompt_tokens,
        frame.num_output_tokens,
        frame.num_prompt_tokens + frame.num_output_tokens,
    )


def _frame_error(frame: TextFrame) -> APIError:
    return APIError(frame.error_status or 500, frame.error or "the request failed")


# ---------------------------------------------------------------- chat


async def chat_completion(
    ctx: ServingContext, http: Request, request: ChatCompletionRequest
) -> Response:
    check_model(ctx, request.model)
    reject_unsupported(request)
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    prompt_ids = await chat_prompt_ids(ctx, request)
    prepared = await prepare(ctx, request, prompt_ids, "chat", "chatcmpl")
    queue = await _submit(ctx, prepared)
    frames = _frames(ctx, http, prepared, queue)
    if request.stream:
        return _sse(_chat_stream(ctx, request, prepared, frames))
    return await _chat_response(ctx, prepared, frames)


async def _chat_response(ctx, prepared: PreparedRequest, frames) -> Response:
    texts, last = [], None
    async with aclosing(frames):
        async for frame in frames:
            texts.append(frame.text)
            last = frame
    if last is None:
        return Response(status_code=499)  # the client left; nobody reads this
    if last.finish_reason == "error":
        raise _frame_error(last)
    body = ChatCompletion(
        id=prepared.request_id,
        created=prepared.created,
        model=ctx.model_name,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage("assistant", "".join(texts)),
                finish_reason=last.finish_reason,
                stop_reason=last.stop_reason,
            )
        ],
        usage=_usage(last),
    )
    return Response(_json.encode(body), media_type="application/json")


async def _chat_stream(ctx, request: ChatCompletionRequest, prepared, frames):
    include_usage = request.stream_options is not None and request.stream_options.include_usage

    def chunk(delta: Delta, finish=None, stop_reason=None) -> bytes:
        choice = ChatChunkChoice(0, delta, finish, stop_reason)
        body = ChatCompletionChunk(prepared.request_id, prepared.created, ctx.model_name, [choice])
        return _event(body)

    yield chunk(Delta(role="assistant"))
    async for frame in frames:
        if frame.finish_reason == "error":
            yield _event(error_body(frame.error_status or 500, frame.error or "request failed"))
            break
        if frame.finish_reason is None:
            if frame.text:
                yield chunk(Delta(content=frame.text))
            continue
        delta = Delta(content=frame.text) if frame.text else Delta()
        yield chunk(delta, frame.finish_reason, frame.stop_reason)
        if include_usage:
            yield _event(
                ChatCompletionChunk(
                    prepared.request_id, prepared.created, ctx.model_name, [], _usage(frame)
                )
            )
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------- completions


async def completion(ctx: ServingContext, http: Request, request: CompletionRequest) -> Response:
    check_model(ctx, request.model)
    reject_unsupported(request)
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    prompt_ids = await completion_prompt_ids(ctx, request)
    prepared = await prepare(ctx, request, prompt_ids, "completions", "cmpl")
    queue = await _submit(ctx, prepared)
    frames = _frames(ctx, http, prepared, queue)
    if request.stream:
        return _sse(_completion_stream(ctx, request, prepared, frames))
    return await _completion_response(ctx, prepared, frames)


async def _completion_response(ctx, prepared: PreparedRequest, frames) -> Response:
    texts, last = [], None
    async with aclosing(frames):
        async for frame in frames:
            texts.append(frame.text)
            last = frame
    if last is None:
        return Response(status_code=499)
    if last.finish_reason == "error":
        raise _frame_error(last)
    choice = CompletionChoice(0, "".join(texts), last.finish_reason, last.stop_reason)
    body = Completion(prepared.request_id, prepared.created, ctx.model_name, [choice], _usage(last))
    return Response(_json.encode(body), media_type="application/json")


async def _completion_stream(ctx, request: CompletionRequest, prepared, frames):
    include_usage = request.stream_options is not None and request.stream_options.include_usage

    def chunk(text: str, finish=None, stop_reason=None, usage=None) -> bytes:
        choices = [] if usage else [CompletionChoice(0, text, finish, stop_reason)]
        return _event(
            Completion(prepared.request_id, prepared.created, ctx.model_name, choices, usage)
        )

    async with aclosing(frames):
        async for frame in frames:
            if frame.finish_reason == "error":
                yield _error_event(frame)
                break
            if frame.finish_reason is None:
                if frame.text:
                    yield chunk(frame.text)
                continue
            yield chunk(frame.text, frame.finish_reason, frame.stop_reason)
            if include_usage:
                yield chunk("", usage=_usage(frame))
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------- SSE


def _error_event(frame: TextFrame) -> bytes:
    return _event(error_body(frame.error_status or 500, frame.error or "the request failed"))


def _event(body: msgspec.Struct) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


def _sse(events) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
