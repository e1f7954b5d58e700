"""From a parsed request to an HTTP response: input stage, engine submission, output shaping.

Route handlers stay thin; this module turns the engine's text frames into OpenAI bodies and
SSE chunks, streaming or not, and makes sure every accepted request ends with a response or
an error and, if the client leaves, an abort that frees its pages.

A request with n > 1 (or best_of) runs as that many engine requests ("candidates") that
share one frame queue; each candidate's frames carry its request id, which maps to its index.
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
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from frontend.budgets import BudgetError, TokenizeParams
from frontend.engine_client import EngineClient, EngineUnavailable
from frontend.errors import APIError, bad_request, error_body
from frontend.input_stage import _render as render_messages
from frontend.input_stage import chat_prompt_ids, completion_prompt_ids
from frontend.output_format import (
    chat_logprobs,
    completion_logprobs,
)
from frontend.sampling import Plan, check_request, plan_request
from frontend.tokenization import Tokenization
from shared.protocol import EngineRequest, LogprobEntry, TextFrame, pack_ids

_json = msgspec.json.Encoder()
_DISCONNECTED = object()  # queue sentinel: the client went away


class ServingContext(msgspec.Struct):
    client: EngineClient
    tokenization: Tokenization
    model_name: str
    vocab_size: int


class Job(msgspec.Struct):
    """One HTTP request's engine work: one engine request per candidate."""

    request_id: str
    created: int
    prompt_ids: list[int]
    plan: Plan
    candidates: list[EngineRequest]
    index_of: dict[str, int]


class Candidate(msgspec.Struct):
    """Everything one candidate produced, for non-streaming answers and best_of ranking."""

    texts: list[str] = []
    logprobs: list[LogprobEntry] = []
    prompt_logprobs: list[LogprobEntry] | None = None
    last: TextFrame | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def score(self) -> float:
        if self.last is None or self.last.cumulative_logprob is None:
            return float("-inf")
        return self.last.cumulative_logprob


def check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model '{model}' does not exist.", "model")


def max_model_len(ctx: ServingContext) -> int:
    if ctx.client.stats is None or not ctx.client.engine_alive:
        raise APIError(503, "The engine is not available; try again shortly.")
    return ctx.client.stats.max_model_len


# ---------------------------------------------------------------- engine requests


def build_job(
    ctx: ServingContext,
    request: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    endpoint: str,
    prefix: str,
) -> Job:
    plan = plan_request(
        request, endpoint=endpoint, prompt_len=len(prompt_ids),
        max_model_len=max_model_len(ctx), vocab_size=ctx.vocab_size,
    )
    request_id = f"{prefix}-{request.request_id or uuid.uuid4().hex}"
    packed = pack_ids(prompt_ids)
    now = time.time()
    candidates = []
    for i in range(plan.candidates):
        params = plan.params
        if params.seed is not None and i > 0:
            # Each candidate draws its own sample; seed + i keeps the set reproducible. The
            # engine's generators take seeds below 2**64, so wrap rather than overflow.
            params = msgspec.structs.replace(params, seed=(params.seed + i) % 2**64)
        candidates.append(EngineRequest(
            request_id=request_id if plan.candidates == 1 else f"{request_id}-{i}",
            prompt_token_ids=packed, params=params, reply_to=ctx.client.result_address,
            arrival_time=now, output=plan.output,
            cache_salt=request.cache_salt, priority=request.priority,  # SPEC P-12
        ))
    index_of = {c.request_id: i for i, c in enumerate(candidates)}
    return Job(request_id, int(now), prompt_ids, plan, candidates, index_of)


async def _submit(ctx: ServingContext, job: Job) -> asyncio.Queue:
    for candidate in job.candidates:
        if ctx.client.in_flight(candidate.request_id):
            # Registering it again would steal the running request's frames.
            raise APIError(
                400, f"a request with request_id {candidate.request_id!r} is already running",
                "request_id",
            )
    queue: asyncio.Queue = asyncio.Queue()
    try:
        for candidate in job.candidates:
            await ctx.client.submit(candidate, job.prompt_ids, queue)
    except EngineUnavailable as exc:
        for candidate in job.candidates:
            await ctx.client.abort(candidate.request_id)
        raise APIError(503, str(exc)) from exc
    return queue


async def _watch_disconnect(http: Request, queue: asyncio.Queue) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(_DISCONNECTED)
            return


async def _frames(
    ctx: ServingContext, http: Request, job: Job, queue: asyncio.Queue
) -> AsyncIterator[tuple[int, TextFrame]]:
    """(candidate index, frame) until every candidate finishes; aborts the rest if the client
    leaves first."""
    watcher = asyncio.create_task(_watch_disconnect(http, queue))
    unfinished = set(job.index_of)
    try:
        while unfinished:
            frame = await queue.get()
            if frame is _DISCONNECTED:
                return
            if frame.finish_reason is not None:
                unfinished.discard(frame.request_id)
            yield job.index_of[frame.request_id], frame
    finally:
        watcher.cancel()
        for request_id in unfinished:
            await ctx.client.abort(request_id)
        for request_id in job.index_of:
            ctx.client.release(request_id)


async def _collect(frames) -> list[Candidate] | None:
    """Gathers a whole job; None when the client left first."""
    results: dict[int, Candidate] = {}
    async with aclosing(frames):
        async for index, frame in frames:
            c = results.setdefault(index, Candidate([], []))
            c.texts.append(frame.text)
            c.logprobs.extend(frame.logprobs or ())
            if frame.prompt_logprobs is not None:
                c.prompt_logprobs = frame.prompt_logprobs
            c.last = frame
            if frame.finish_reason == "error":
                raise _frame_error(frame)
    if not results or any(c.last is None or c.last.finish_reason is None
                          for c in results.values()):
        return None
    return [results[i] for i in sorted(results)]


def _best(job: Job, candidates: list[Candidate]) -> list[Candidate]:
    """The n answers to return: all of them, or the best n by cumulative logprob (P-10)."""
    if job.plan.candidates == job.plan.n:
        return candidates
    return sorted(candidates, key=lambda c: c.score, reverse=True)[: job.plan.n]


def _usage(candidates: list[Candidate]) -> Usage:
    prompt = candidates[0].last.num_prompt_tokens
    completion = sum(c.last.num_output_tokens for c in candidates)
    return Usage(prompt, completion, prompt + completion)


def _frame_error(frame: TextFrame) -> APIError:
    return APIError(frame.error_status or 500, frame.error or "the request failed")


def _error_event(frame: TextFrame) -> bytes:
    return _event(error_body(frame.error_status or 500, frame.error or "the request failed"))


class StreamUsage(msgspec.Struct):
    """Running token counts of a streamed job, per candidate."""

    prompt_tokens: int = 0
    completion_tokens: dict[int, int] = {}

    def update(self, index: int, frame: TextFrame) -> None:
        self.prompt_tokens = frame.num_prompt_tokens
        self.completion_tokens[index] = frame.num_output_tokens

    def total(self) -> Usage:
        completion = sum(self.completion_tokens.values())
        return Usage(self.prompt_tokens, completion, self.prompt_tokens + completion)


# ---------------------------------------------------------------- chat


async def chat_completion(
    ctx: ServingContext, http: Request, request: ChatCompletionRequest
) -> Response:
    check_model(ctx, request.model)
    check_request(request)
    prompt_ids = await chat_prompt_ids(ctx, request)
    job = build_job(ctx, request, prompt_ids, "chat", "chatcmpl")
    frames = _frames(ctx, http, job, await _submit(ctx, job))
    if request.stream:
        return _sse(_chat_stream(ctx, request, job, frames))
    candidates = await _collect(frames)
    if candidates is None:
        return Response(status_code=499)  # the client left; nobody reads this
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage("assistant", c.text),
            finish_reason=c.last.finish_reason,
            stop_reason=c.last.stop_reason,
            logprobs=chat_logprobs(c.logprobs) if job.plan.params.logprobs is not None else None,
        )
        for i, c in enumerate(_best(job, candidates))
    ]
    body = ChatCompletion(job.request_id, job.created, ctx.model_name, choices,
                          _usage(candidates))
    return Response(_json.encode(body), media_type="application/json")


async def _chat_stream(ctx, request: ChatCompletionRequest, job: Job, frames):
    options = request.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    want_logprobs = job.plan.params.logprobs is not None
    usage = StreamUsage()

    def chunk(choices, with_usage=None) -> bytes:
        return _event(ChatCompletionChunk(job.request_id, job.created, ctx.model_name, choices,
                                          with_usage))

    opening = Usage(len(job.prompt_ids), 0, len(job.prompt_ids)) if continuous else None
    for i in range(job.plan.n):
        yield chunk([ChatChunkChoice(i, Delta(role="assistant"))], opening)
    async with aclosing(frames):
        async for index, frame in frames:
            if frame.finish_reason == "error":
                yield _error_event(frame)
                break
            usage.update(index, frame)
            if frame.finish_reason is None and not frame.text:
                continue
            logprobs = chat_logprobs(frame.logprobs or []) if want_logprobs else None
            delta = Delta(content=frame.text) if frame.text else Delta()
            choice = ChatChunkChoice(index, delta, frame.finish_reason, frame.stop_reason,
                                     logprobs)
            yield chunk([choice], usage.total() if continuous else None)
    if include_usage:
        yield chunk([], usage.total())
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------- completions


async def completion(ctx: ServingContext, http: Request, request: CompletionRequest) -> Response:
    check_model(ctx, request.model)
    check_request(request)
    prompt_ids = await completion_prompt_ids(ctx, request)
    job = build_job(ctx, request, prompt_ids, "completions", "cmpl")
    echo_text = await _echo_text(ctx, request, prompt_ids)
    frames = _frames(ctx, http, job, await _submit(ctx, job))
    if request.stream:
        return _sse(_completion_stream(ctx, request, job, frames, echo_text))
    candidates = await _collect(frames)
    if candidates is None:
        return Response(status_code=499)
    choices = []
    for i, c in enumerate(_best(job, candidates)):
        logprobs = None
        if job.plan.params.logprobs is not None and request.logprobs is not None:
            entries = (c.prompt_logprobs or []) + c.logprobs
            logprobs = completion_logprobs(entries, start_offset=0)
        choices.append(CompletionChoice(i, echo_text + c.text, c.last.finish_reason,
                                        c.last.stop_reason, logprobs))
    body = Completion(job.request_id, job.created, ctx.model_name, choices,
                      _usage(candidates))
    return Response(_json.encode(body), media_type="application/json")


async def _echo_text(ctx: ServingContext, request: CompletionRequest, prompt_ids) -> str:
    if not request.echo:
        return ""
    if isinstance(request.prompt, str):
        return request.prompt
    return await ctx.tokenization.decode(prompt_ids, skip_special_tokens=False)


async def _completion_stream(ctx, request: CompletionRequest, job: Job, frames, echo_text):
    options = request.stream_options
    include_usage = options is not None and options.include_usage
    continuous = options is not None and options.continuous_usage_stats
    want_logprobs = request.logprobs is not None
    usage = StreamUsage()
    offsets = [0] * job.plan.n
    echoed = [False] * job.plan.n

    def chunk(choices, with_usage=None) -> bytes:
        return _event(Completion(job.request_id, job.created, ctx.model_name, choices,
                                 with_usage))

    async with aclosing(frames):
        async for index, frame in frames:
            if frame.finish_reason == "error":
                yield _error_event(frame)
                break
            usage.update(index, frame)
            entries = list(frame.logprobs or ())
            text = frame.text
            if request.echo and not echoed[index]:
                echoed[index] = True
                text = echo_text + text
                entries = list(frame.prompt_logprobs or ()) + entries
            if frame.finish_reason is None and not text:
                continue
            logprobs = None
            if want_logprobs:
                logprobs = completion_logprobs(entries, start_offset=offsets[index])
            offsets[index] += len(text)
            choice = CompletionChoice(index, text, frame.finish_reason, frame.stop_reason,
                                      logprobs)
            yield chunk([choice], usage.total() if continuous else None)
    if include_usage:
        yield chunk([], usage.total())
    yield b"data: [DONE]\n\n"


# ---------------------------------------------------------------- SSE


def _event(body: msgspec.Struct) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


def _sse(events) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# ---------------------------------------------------------------- /tokenize, /detokenize


async def tokenize(ctx: ServingContext, request: TokenizeRequest) -> TokenizeResponse:
    """vLLM's /tokenize: the ids a prompt (or rendered messages) would have, under the same
    budgets as a generation request, so a text too long to serve is a 400 here too."""
    check_model(ctx, request.model)
    limit = max_model_len(ctx)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
    if request.prompt is not None:
        text, field, add_special = request.prompt, "prompt", True
    else:
        if not request.messages:
            raise bad_request("messages must not be empty", "messages")
        chat = ChatCompletionRequest(
            messages=request.messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=request.tools,
        )
        # The template already holds BOS, so no special tokens by default (SPEC T-4).
        text, field, add_special = (await render_messages(ctx, chat)).text, "messages", False
    if request.add_special_tokens is not None:
        add_special = request.add_special_tokens
    params = TokenizeParams(max_total_tokens=limit, add_special_tokens=add_special)
    try:
        tokens = await ctx.tokenization.tokenize(text, params)
    except BudgetError as exc:
        raise bad_request(str(exc), exc.param or field) from exc
    return TokenizeResponse(count=len(tokens.ids), max_model_len=limit, tokens=tokens.ids)


async def detokenize(ctx: ServingContext, request: DetokenizeRequest) -> DetokenizeResponse:
    check_model(ctx, request.model)
    for token_id in request.tokens:
        if not 0 <= token_id < ctx.vocab_size:
            raise bad_request(
                f"token id {token_id} is outside the vocabulary [0, {ctx.vocab_size})", "tokens"
            )
    # As vLLM (and tokenizer.decode's default): special tokens stay in the text.
    text = await ctx.tokenization.decode(request.tokens, skip_special_tokens=False)
    return DetokenizeResponse(prompt=text)
