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
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from frontend.budgets import BudgetError, TokenizeParams
from frontend.engine_client import EngineClient, EngineUnavailable
from frontend.errors import APIError, bad_request, error_body
from frontend.input_bounds import RequestLimits, check_bounds
from frontend.input_stage import PromptInput, chat_input, completion_inputs
from frontend.input_stage import _render as render_messages
from frontend.sampling import Plan, check_request, plan_request
from frontend.structured import StructuredSettings, constraint_for
from frontend.tokenization import Tokenization
from postproc.chunks import sse_event
from postproc.openai_shapes import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    Usage,
    chat_logprobs,
    completion_logprobs,
    reasoning_delta,
)
from postproc.reasoning import get_reasoning_parser
from postproc.tool_parsers import ToolDelta, collect
from shared.protocol import (
    ChunkFormat,
    Constraint,
    EngineRequest,
    LogprobEntry,
    OutputParams,
    TextFrame,
    ToolCallDelta,
    pack_ids,
)

_json = msgspec.json.Encoder()
_DISCONNECTED = object()  # queue sentinel: the client went away


class OutputSettings(msgspec.Struct, frozen=True):
    """The server's output parsers (flags); applied to chat requests."""

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    reasoning_field: str = "reasoning_content"
    # The parsers' delimiters are special tokens of this tokenizer, so requests they parse
    # keep special tokens in their text (SPEC O-6); the parsers take the delimiters out.
    keep_special_tokens: bool = False


class ServingContext(msgspec.Struct):
    client: EngineClient
    tokenization: Tokenization
    model_name: str
    vocab_size: int
    output: OutputSettings = OutputSettings()
    limits: RequestLimits = RequestLimits()  # the server's maxima per request (flags)


class Job(msgspec.Struct):
    """One HTTP request's engine work: `plan.candidates` engine requests per prompt.

    Candidate c belongs to prompt c // plan.candidates; when every candidate is returned
    (best_of == n), c is also its choice index.
    """

    request_id: str
    created: int
    prompts: list[PromptInput]
    plan: Plan
    candidates: list[EngineRequest]
    index_of: dict[str, int]  # engine request id -> candidate number

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.tokens.ids) for p in self.prompts)


class Candidate(msgspec.Struct):
    """Everything one candidate produced, for non-streaming answers and best_of ranking."""

    texts: list[str] = msgspec.field(default_factory=list)
    reasoning: list[str] = msgspec.field(default_factory=list)
    tool_calls: list[ToolCallDelta] = msgspec.field(default_factory=list)
    logprobs: list[LogprobEntry] = msgspec.field(default_factory=list)
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


def structured_settings(ctx: ServingContext) -> StructuredSettings:
    """The server's tool-call / reasoning parsers and llguidance tokenizer, for the checks
    and grammars of structured output (none without a tokenization stage, as in unit tests)."""
    if ctx.tokenization is None:
        return StructuredSettings()
    return ctx.tokenization.settings.structured


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
    prompts: list[PromptInput],
    endpoint: str,
    prefix: str,
    constraint: Constraint | None = None,
) -> Job:
    """`constraint`: the request's grammar, checked once (`constraint_for`) for all its
    prompts and candidates."""
    request_id = f"{prefix}-{request.request_id or uuid.uuid4().hex}"
    now = time.time()
    plans = [
        plan_request(request, endpoint=endpoint, prompt_len=len(p.tokens.ids),
                     max_model_len=max_model_len(ctx), vocab_size=ctx.vocab_size,
                     constraint=constraint)
        for p in prompts
    ]
    job = Job(request_id, int(now), prompts, plans[0], [], {})
    for p, (prompt, plan) in enumerate(zip(prompts, plans, strict=True)):
        packed = pack_ids(prompt.tokens.ids)
        for i in range(plan.candidates):
            number = p * plan.candidates + i
            params = plan.params
            if params.seed is not None and number > 0:
                # Each candidate draws its own sample; seed + i keeps the set reproducible.
                # The engine's generators take seeds below 2**64, so wrap, not overflow.
                params = msgspec.structs.replace(params, seed=(params.seed + number) % 2**64)
            many = len(prompts) * plan.candidates > 1
            job.candidates.append(EngineRequest(
                request_id=f"{request_id}-{number}" if many else request_id,
                prompt_token_ids=packed, params=params,
                reply_to=ctx.client.result_address, arrival_time=now,
                output=_output_params(ctx, request, job, plan, prompt, number),
                cache_salt=request.cache_salt, priority=request.priority,  # SPEC P-12
            ))
    job.index_of = {c.request_id: i for i, c in enumerate(job.candidates)}
    return job


def _output_params(ctx, request, job: Job, plan: Plan, prompt: PromptInput,
                   number: int) -> OutputParams:
    """The plan's output params plus what only the serving layer knows: parsers, and for a
    stream the chunk format, so whoever post-processes it writes the bytes."""
    changes: dict = {}
    settings = ctx.output
    chat = isinstance(request, ChatCompletionRequest)
    forced_call = bool(prompt.rendered and prompt.rendered.injected_prefix)
    # After a forced call's opening the output is inside the call, not thinking.
    if chat and settings.reasoning_parser and not forced_call:
        template_text = prompt.rendered.template_text if prompt.rendered else ""
        parser = get_reasoning_parser(settings.reasoning_parser)
        changes.update(reasoning_parser=settings.reasoning_parser,
                       starts_in_reasoning=parser.initial_thinking(template_text))
    if chat and settings.tool_call_parser and request.tools and request.tool_choice != "none":
        changes.update(tool_parser=settings.tool_call_parser,
                       tools=msgspec.json.encode(request.tools),
                       tool_prefill=prompt.rendered.injected_prefix if prompt.rendered else "")
    if changes and settings.keep_special_tokens:
        changes["skip_special_tokens"] = False
    if request.stream:
        changes["chunk"] = ChunkFormat(
            kind="chat" if chat else "completion", response_id=job.request_id,
            created=job.created, model=ctx.model_name, index=number,
            logprobs=(plan.params.logprobs is not None if chat
                      else request.logprobs is not None),
            continuous_usage=bool(request.stream_options
                                  and request.stream_options.continuous_usage_stats),
            echo=(prompt.source_text or "") if not chat and request.echo else "",
            reasoning_field=settings.reasoning_field,
        )
    return msgspec.structs.replace(plan.output, **changes)


async def _add_echo_texts(ctx: ServingContext, prompts: list[PromptInput]) -> None:
    """Token-id prompts echo as what they decode to; text prompts as the client wrote them."""
    for prompt in prompts:
        if prompt.source_text is None:
            prompt.source_text = await ctx.tokenization.decode(prompt.tokens.ids,
                                                               skip_special_tokens=False)


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
            prompt = job.prompts[job.index_of[candidate.request_id] // job.plan.candidates]
            await ctx.client.submit(candidate, prompt.tokens.ids, queue)
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
    """(candidate number, frame) until every candidate finishes; aborts the rest if the
    client leaves first."""
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
    """Gathers a whole job, candidates in order; None when the client left first."""
    results: dict[int, Candidate] = {}
    async with aclosing(frames):
        async for number, frame in frames:
            c = results.setdefault(number, Candidate())
            c.texts.append(frame.text)
            if frame.reasoning:
                c.reasoning.append(frame.reasoning)
            c.tool_calls.extend(frame.tool_calls)
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


def _chosen(job: Job, candidates: list[Candidate]) -> list[tuple[int, Candidate]]:
    """(prompt number, candidate) of the answers to return, in choice order: per prompt, all
    its candidates, or the best n by cumulative logprob (P-10)."""
    per_prompt = job.plan.candidates
    chosen = []
    for p in range(len(job.prompts)):
        group = candidates[p * per_prompt:(p + 1) * per_prompt]
        if per_prompt != job.plan.n:
            group = sorted(group, key=lambda c: c.score, reverse=True)[: job.plan.n]
        chosen.extend((p, c) for c in group)
    return chosen


def _usage(job: Job, candidates: list[Candidate]) -> Usage:
    prompt = job.num_prompt_tokens
    completion = sum(c.last.num_output_tokens for c in candidates)
    return Usage(prompt, completion, prompt + completion)


def _frame_error(frame: TextFrame) -> APIError:
    return APIError(frame.error_status or 500, frame.error or "the request failed")


def _error_event(frame: TextFrame) -> bytes:
    return sse_event(error_body(frame.error_status or 500, frame.error or "the request failed"))


class StreamUsage(msgspec.Struct):
    """Running token counts of a streamed job."""

    prompt_tokens: int
    completion_tokens: dict[int, int] = msgspec.field(default_factory=dict)

    def update(self, number: int, frame: TextFrame) -> None:
        self.completion_tokens[number] = frame.num_output_tokens

    def total(self) -> Usage:
        completion = sum(self.completion_tokens.values())
        return Usage(self.prompt_tokens, completion, self.prompt_tokens + completion)


async def _stream(job: Job, frames, opening: list[bytes], include_usage: bool, usage_chunk):
    """SSE bytes of a streamed job: the opening chunks, each frame's ready-made chunk (written
    by postproc), an error event if a candidate fails, the usage chunk, `[DONE]` (O-1)."""
    for chunk in opening:
        yield chunk
    usage = StreamUsage(job.num_prompt_tokens)
    async with aclosing(frames):
        async for number, frame in frames:
            if frame.finish_reason == "error":
                yield _error_event(frame)
                break
            usage.update(number, frame)
            if frame.chunk:
                yield frame.chunk
    if include_usage:
        yield usage_chunk(usage.total())
    yield b"data: [DONE]\n\n"


def _stream_options(request) -> tuple[bool, bool]:
    options = request.stream_options
    if options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


# ---------------------------------------------------------------- chat


async def start_chat(
    ctx: ServingContext, http: Request, request: ChatCompletionRequest, prefix: str = "chatcmpl"
) -> tuple[Job, AsyncIterator[tuple[int, TextFrame]]]:
    """Checks, renders, tokenizes and submits a chat request; returns its job and its frames
    ((candidate number, TextFrame) until every candidate finishes, the engine requests aborted
    if the client leaves). The other protocols (`frontend.responses_api`,
    `frontend.anthropic_api`) translate their requests into chat requests with `stream`
    off, so no chat-chunk bytes are written, and shape the frames themselves.

    Close the frames (`aclosing`) when done with them: that aborts unfinished candidates."""
    check_model(ctx, request.model)
    check_request(request, structured_settings(ctx), ctx.limits)
    prompt = await chat_input(ctx, request)
    constraint = await constraint_for(request, structured_settings(ctx))
    job = build_job(ctx, request, [prompt], "chat", prefix, constraint)
    return job, _frames(ctx, http, job, await _submit(ctx, job))


async def chat_completion(
    ctx: ServingContext, http: Request, request: ChatCompletionRequest
) -> Response:
    job, frames = await start_chat(ctx, http, request)
    if request.stream:
        return _sse(_chat_stream(ctx, request, job, frames))
    candidates = await _collect(frames)
    if candidates is None:
        return Response(status_code=499)  # the client left; nobody reads this
    want_logprobs = job.plan.params.logprobs is not None
    choices = [
        ChatChoice(
            index=i,
            message=_message(ctx, c),
            finish_reason=c.last.finish_reason,
            stop_reason=c.last.stop_reason,
            logprobs=chat_logprobs(c.logprobs) if want_logprobs else None,
        )
        for i, (_, c) in enumerate(_chosen(job, candidates))
    ]
    body = ChatCompletion(job.request_id, job.created, ctx.model_name, choices,
                          _usage(job, candidates))
    return Response(_json.encode(body), media_type="application/json")


def _message(ctx: ServingContext, c: Candidate) -> AssistantMessage:
    calls = collect([ToolDelta("", c.tool_calls)]).calls if c.tool_calls else []
    text = c.text
    return AssistantMessage(
        role="assistant",
        content=(text or None) if calls else text,
        tool_calls=calls or None,
        **reasoning_delta(ctx.output.reasoning_field, "".join(c.reasoning)),
    )


def _chat_stream(ctx, request: ChatCompletionRequest, job: Job, frames):
    include_usage, continuous = _stream_options(request)

    def chunk(choices, usage=None) -> bytes:
        return sse_event(ChatCompletionChunk(job.request_id, job.created, ctx.model_name,
                                             choices, usage))

    prompt_tokens = job.num_prompt_tokens
    opening_usage = Usage(prompt_tokens, 0, prompt_tokens) if continuous else None
    opening = [chunk([ChatChunkChoice(i, Delta(role="assistant"))], opening_usage)
               for i in range(job.plan.n)]
    return _stream(job, frames, opening, include_usage, lambda usage: chunk([], usage))


# ---------------------------------------------------------------- completions


async def completion(ctx: ServingContext, http: Request, request: CompletionRequest) -> Response:
    check_model(ctx, request.model)
    check_request(request, structured_settings(ctx), ctx.limits)
    prompts = await completion_inputs(ctx, request)
    if request.echo:
        await _add_echo_texts(ctx, prompts)
    constraint = await constraint_for(request, structured_settings(ctx))
    job = build_job(ctx, request, prompts, "completions", "cmpl", constraint)
    frames = _frames(ctx, http, job, await _submit(ctx, job))
    if request.stream:
        include_usage, _ = _stream_options(request)

        def usage_chunk(usage: Usage) -> bytes:
            return sse_event(Completion(job.request_id, job.created, ctx.model_name, [], usage))

        return _sse(_stream(job, frames, [], include_usage, usage_chunk))
    candidates = await _collect(frames)
    if candidates is None:
        return Response(status_code=499)
    choices = []
    for i, (p, c) in enumerate(_chosen(job, candidates)):
        echo = (prompts[p].source_text or "") if request.echo else ""
        logprobs = None
        if job.plan.params.logprobs is not None and request.logprobs is not None:
            entries = (c.prompt_logprobs or []) + c.logprobs
            logprobs = completion_logprobs(entries, start_offset=0)
        choices.append(CompletionChoice(i, echo + c.text, c.last.finish_reason,
                                        c.last.stop_reason, logprobs))
    body = Completion(job.request_id, job.created, ctx.model_name, choices,
                      _usage(job, candidates))
    return Response(_json.encode(body), media_type="application/json")


# ---------------------------------------------------------------- SSE


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
        check_bounds(chat, ctx.limits)  # message and tool counts, tool-call arguments' depth
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
