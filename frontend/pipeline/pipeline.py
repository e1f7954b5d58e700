"""The request pipeline every protocol face shares: request → engine jobs → frames → results.

In the order a request meets them: `start_job` (where the OpenAI routes, the Responses API
and the Messages API all start) checks the request and runs the input stage; `build_job`
turns it and its prompts into engine requests (one plan per request, max_tokens per
prompt), `submit` sends them, `job_frames` yields their frames until every candidate
finishes (aborting the rest if the client leaves), and `frame_loop`, the one loop over those
frames, hands each to what a face makes of it: `collect_candidates` gathers a whole OpenAI
answer, `sse_stream` forwards postproc's chunk bytes, and the Responses and Messages APIs
feed their blocks (`protocol_edge.block_events`).

A request with n > 1 (or best_of) runs as that many engine requests ("candidates") that
share one frame queue; each candidate's frames carry its request id, which maps to its index.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from typing import TypeVar

import msgspec
from starlette.requests import Request

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.base.errors import APIError, error_body
from frontend.engine_client import request_metrics
from frontend.engine_client.client import EngineUnavailable
from frontend.engine_client.lora_client import lora_name_for
from frontend.engine_client.placement import RoutingHints
from frontend.input.scheduling_hints import affinity_id, priority_tier
from frontend.input.structured import constraint_for, forces_call
from frontend.pipeline.input_stage import PromptInput, chat_input, completion_inputs
from frontend.pipeline.job import Candidate, Job
from frontend.pipeline.sampling import (
    Plan,
    check_request,
    prompt_max_tokens,
    prompt_params,
    request_plan,
)
from frontend.pipeline.serving_context import (
    ServingContext,
    check_model,
    frame_error,
    max_model_len,
    structured_settings,
)
from frontend.pipeline.tracing import current, engine_context, note_frame, note_job, phase
from postproc.chunks import sse_event
from postproc.openai_shapes import CompletionTokensDetails, PromptTokensDetails, Usage
from postproc.reasoning import get_reasoning_parser
from shared.log_format import name_request
from shared.protocol import (
    ChunkFormat,
    Constraint,
    EngineRequest,
    OutputParams,
    TextFrame,
    ThinkingBudget,
    pack_ids,
)

_DISCONNECTED = object()  # queue sentinel: the client went away
T = TypeVar("T")
Frames = AsyncIterator[tuple[int, TextFrame]]  # a job's (candidate number, frame)s
# What a face makes of one frame: chunk bytes, block events, or nothing (it gathers).
OnFrame = Callable[[int, TextFrame], Iterable[T] | None]


# ---------------------------------------------------------------- the way in

_ID_PREFIXES = {"chat": "chatcmpl", "completions": "cmpl"}


async def start_job(
    ctx: ServingContext, http: Request, request: ChatCompletionRequest | CompletionRequest,
    prefix: str | None = None,
) -> tuple[Job, Frames]:
    """Checks, renders (chat) or reads (completions), tokenizes and submits a request;
    returns its job and its frames ((candidate number, TextFrame) until every candidate
    finishes, the engine requests aborted if the client leaves). The other protocols
    (`frontend.responses.api`, `frontend.anthropic.api`) translate their requests into chat
    requests with `stream` off, so no chat-chunk bytes are written, and shape the frames
    themselves; `prefix` starts their ids.

    Close the frames (`aclosing`) when done with them: that aborts unfinished candidates."""
    check_model(ctx, request.model)
    check_request(request, structured_settings(ctx), ctx.limits)
    if isinstance(request, ChatCompletionRequest):
        endpoint, prompts = "chat", [await chat_input(ctx, request)]
    else:
        endpoint, prompts = "completions", await completion_inputs(ctx, request)
        if request.echo:
            await add_echo_texts(ctx, prompts)
    # A chat's thinking state, read from its rendered prompt, shapes a forced call's grammar.
    thinking = endpoint == "chat" and starts_in_reasoning(ctx, request, prompts[0])
    constraint = await constraint_for(request, structured_settings(ctx), thinking)
    bad_words = (await ctx.tokenization.bad_word_ids(request.bad_words) if request.bad_words
                 else None)
    job = build_job(ctx, request, prompts, endpoint, prefix or _ID_PREFIXES[endpoint],
                    constraint, bad_words, thinking_budget(ctx, request, thinking))
    return job, job_frames(ctx, http, job, await submit(ctx, job))


# ---------------------------------------------------------------- engine requests


def build_job(
    ctx: ServingContext,
    request: ChatCompletionRequest | CompletionRequest,
    prompts: list[PromptInput],
    endpoint: str,
    prefix: str,
    constraint: Constraint | None = None,
    bad_words: list[list[int]] | None = None,
    thinking: ThinkingBudget | None = None,
) -> Job:
    """`constraint`: the request's grammar, checked once (`constraint_for`) for all its
    prompts and candidates; `bad_words` its bad words as token sequences. The plan is built
    once too; only max_tokens is per prompt."""
    request_id = f"{prefix}-{request.request_id or uuid.uuid4().hex}"
    name_request(request_id)  # this task's log lines carry it from here (--log-format json)
    now = time.time()
    # Every prompt's room first: a prompt too long for the context is the likeliest 400.
    limit = max_model_len(ctx)
    max_tokens = [prompt_max_tokens(request, endpoint, p.num_tokens, limit,
                                    ctx.generation_defaults) for p in prompts]
    plan = request_plan(request, vocab_size=ctx.vocab_size, constraint=constraint,
                        defaults=ctx.generation_defaults, bad_words=bad_words,
                        thinking=thinking)
    lora_name = lora_name_for(ctx, getattr(request, "model", None))
    job = Job(request_id, int(now), prompts, plan, [], {}, model=lora_name or ctx.model_name,
              routing=routing_hints(ctx, request))
    trace_context = engine_context()  # the engine's and postproc's spans join this request's
    for p, (prompt, prompt_max) in enumerate(zip(prompts, max_tokens, strict=True)):
        packed = pack_ids(prompt.tokens.ids)
        prompt_sampling = prompt_params(plan, prompt_max)
        for i in range(plan.candidates):
            number = p * plan.candidates + i
            params = prompt_sampling
            if params.seed is not None and number > 0:
                # Each candidate draws its own sample; seed + i keeps the set reproducible.
                # The engine's generators take seeds below 2**64, so wrap, not overflow.
                params = msgspec.structs.replace(params, seed=(params.seed + number) % 2**64)
            many = len(prompts) * plan.candidates > 1
            job.candidates.append(EngineRequest(
                request_id=f"{request_id}-{number}" if many else request_id,
                prompt_token_ids=packed, params=params,
                reply_to=ctx.client.result_address, arrival_time=now,
                output=output_params(ctx, request, job, plan, prompt, number),
                cache_salt=request.cache_salt, priority=request.priority,  # req P-12
                images=prompt.images,
                lora_name=lora_name, trace_context=trace_context,
                priority_tier=priority_tier(request),
            ))
    job.index_of = {c.request_id: i for i, c in enumerate(job.candidates)}
    note_job(job, endpoint, request)
    return job


def routing_hints(ctx: ServingContext, request) -> RoutingHints | None:
    """conversation_params and scheduling_params as placement reads them; a pin to an
    engine rank this frontend does not have is a 400."""
    scheduling = request.scheduling_params
    rank = scheduling.attention_dp_rank if scheduling is not None else None
    affinity = affinity_id(request)
    if rank is None and affinity is None:
        return None
    engines = len(ctx.client.ranked_engines())
    if rank is not None and rank >= engines:
        raise APIError(400, f"scheduling_params.attention_dp_rank {rank} names no engine: "
                            f"this frontend has {engines} (ranks 0 to {engines - 1})",
                       "scheduling_params.attention_dp_rank")
    return RoutingHints(affinity, rank, bool(scheduling and scheduling.attention_dp_relax))


def stream_usage(ctx: ServingContext, request) -> tuple[bool, bool]:
    """(usage chunk at the end, usage on every chunk): stream_options.include_usage (or the
    server's --enable-force-include-usage), and vLLM's continuous_usage_stats, which applies
    only together with include_usage."""
    options = request.stream_options
    if options is None or not options.include_usage:
        return ctx.output.force_include_usage, False
    return True, bool(options.continuous_usage_stats)


def job_usage(ctx: ServingContext, job: Job, completion_tokens: int,
              cached: dict[int, int], reasoning_tokens: int | None = None) -> Usage:
    """A job's usage. `cached`: candidate number -> prompt tokens found in the prefix cache;
    a prompt counts once in prompt_tokens, so its cached tokens count once too (its first
    candidate's), given only with --enable-prompt-tokens-details. `reasoning_tokens`: of
    the completion tokens, the reasoning parser's (None: the job runs no such parser)."""
    prompt = job.num_prompt_tokens
    usage = Usage(prompt, completion_tokens, prompt + completion_tokens)
    if reasoning_tokens is not None:
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens)
    if ctx.output.prompt_tokens_details:
        per_prompt = job.plan.candidates
        usage.prompt_tokens_details = PromptTokensDetails(
            sum(n for number, n in cached.items() if number % per_prompt == 0))
    return usage


def thinking_budget(ctx: ServingContext, request, inside: bool) -> ThinkingBudget | None:
    """A chat's thinking_token_budget for the engine: the reasoning parser's tags as ids
    (read once at start) and whether the prompt left the output inside thinking."""
    budget = getattr(request, "thinking_token_budget", None)
    if budget is None:
        return None
    tags = ctx.output
    return ThinkingBudget(budget, list(tags.think_start_ids), list(tags.think_end_ids), inside)


def starts_in_reasoning(ctx: ServingContext, request: ChatCompletionRequest,
                        prompt: PromptInput) -> bool:
    """Whether the output starts inside a thinking section, as the reasoning parser reads
    the rendered prompt (the template pre-filled `<think>`): one answer for the forced
    call's grammar, the thinking budget and the parser. A named tool_choice's output starts
    inside the call its injected opening began."""
    if ctx.output.reasoning_parser is None or (prompt.rendered and
                                                prompt.rendered.injected_prefix):
        return False
    template_text = prompt.rendered.template_text if prompt.rendered else ""
    return get_reasoning_parser(ctx.output.reasoning_parser).initial_thinking(
        template_text, forced_call=forces_call(request))


def output_params(ctx: ServingContext, request, job: Job, plan: Plan, prompt: PromptInput,
                   number: int) -> OutputParams:
    """The plan's output params plus what only the serving layer knows: parsers, and for a
    stream the chunk format, so whoever post-processes it writes the bytes."""
    changes: dict = {}
    settings = ctx.output
    chat = isinstance(request, ChatCompletionRequest)
    forced_call = bool(prompt.rendered and prompt.rendered.injected_prefix)
    # After a forced call's opening the output is inside the call, not thinking.
    if chat and settings.reasoning_parser and not forced_call:
        changes.update(reasoning_parser=settings.reasoning_parser,
                       starts_in_reasoning=starts_in_reasoning(ctx, request, prompt))
    if chat and settings.tool_call_parser and request.tools and request.tool_choice != "none":
        changes.update(tool_parser=settings.tool_call_parser,
                       tools=msgspec.json.encode(request.tools),
                       tool_prefill=prompt.rendered.injected_prefix if prompt.rendered else "")
    # skip_special_tokens stays as the request says: the postproc step keeps the parsers'
    # own delimiters when they are special tokens (postproc.processor.special_ids_to_skip).
    if settings.return_tokens_as_token_ids:
        changes["tokens_as_ids"] = True
    if request.stream:
        changes["chunk"] = ChunkFormat(
            kind="chat" if chat else "completion", response_id=job.request_id,
            created=job.created, model=job.model, index=number,
            logprobs=(plan.params.logprobs is not None if chat
                      else request.logprobs is not None),
            continuous_usage=stream_usage(ctx, request)[1],
            echo=(prompt.source_text or "") if not chat and request.echo else "",
            reasoning_field=settings.reasoning_field,
            token_ids=bool(request.return_token_ids),
        )
    return msgspec.structs.replace(plan.output, **changes)


async def add_echo_texts(ctx: ServingContext, prompts: list[PromptInput]) -> None:
    """Token-id prompts, and text prompts truncation cut, echo as what their ids decode to;
    other text prompts as the client wrote them."""
    for prompt in prompts:
        if prompt.source_text is None:
            prompt.source_text = await ctx.tokenization.decode(prompt.tokens.ids,
                                                               skip_special_tokens=False)


async def submit(ctx: ServingContext, job: Job) -> asyncio.Queue:
    for candidate in job.candidates:
        if ctx.client.in_flight(candidate.request_id):
            # Registering it again would steal the running request's frames.
            raise APIError(
                400, f"a request with request_id {candidate.request_id!r} is already running",
                "request_id",
            )
    queue: asyncio.Queue = asyncio.Queue()
    try:
        with phase("submit"):  # waiting for a live engine, placing and sending
            for candidate in job.candidates:
                prompt = job.prompts[job.index_of[candidate.request_id] // job.plan.candidates]
                await ctx.client.submit(candidate, prompt.tokens.ids, queue, job.routing)
        for first in job.candidates[::job.plan.candidates]:  # one per prompt
            request_metrics.PARAMS_N.observe(job.plan.n)
            request_metrics.PARAMS_MAX_TOKENS.observe(first.params.max_tokens)
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


async def job_frames(ctx: ServingContext, http: Request, job: Job, queue: asyncio.Queue
                     ) -> Frames:
    """(candidate number, frame) until every candidate finishes; aborts the rest if the
    client leaves first."""
    watcher = asyncio.create_task(_watch_disconnect(http, queue))
    traced = current()
    unfinished = set(job.index_of)
    most = [0] * len(job.prompts)  # the longest answer of each prompt, for vLLM's metric
    failed = False
    try:
        while unfinished:
            frame = await queue.get()
            if frame is _DISCONNECTED:
                return
            number = job.index_of[frame.request_id]
            note_frame(traced, number, frame)
            if frame.finish_reason is not None:
                unfinished.discard(frame.request_id)
                prompt = number // job.plan.candidates
                most[prompt] = max(most[prompt], frame.num_output_tokens)
                failed = failed or frame.finish_reason == "error"
            yield number, frame
        if not failed:
            for tokens in most:
                request_metrics.MAX_NUM_GENERATION_TOKENS.observe(tokens)
    finally:
        watcher.cancel()
        for request_id in unfinished:
            await ctx.client.abort(request_id)
        for request_id in job.index_of:
            ctx.client.release(request_id)


# ---------------------------------------------------------------- the frame loop


async def frame_loop(frames: Frames, on_frame: OnFrame) -> AsyncIterator[T]:
    """The one loop over a job's frames, for every face: feeds each (candidate number,
    frame) to `on_frame` and yields what it makes of it (chunk bytes, block events, or
    nothing while a whole answer is gathered). An error frame raises its APIError before
    `on_frame` sees it. Closing this generator closes the frames, which aborts unfinished
    candidates."""
    async with aclosing(frames):
        async for number, frame in frames:
            if frame.finish_reason == "error":
                raise frame_error(frame)
            for out in on_frame(number, frame) or ():
                yield out


async def run_frames(frames: Frames, on_frame: OnFrame) -> None:
    """`frame_loop` to its end, for whole (non-streamed) answers: `on_frame` gathers."""
    async with aclosing(frame_loop(frames, on_frame)) as outs:
        async for _ in outs:
            pass


async def collect_candidates(frames: Frames) -> list[Candidate] | None:
    """Gathers a whole job, candidates in order; None when the client left first."""
    results: dict[int, Candidate] = {}

    def add(number: int, frame: TextFrame) -> None:
        results.setdefault(number, Candidate()).add(frame)

    await run_frames(frames, add)
    if not results or not all(c.finished for c in results.values()):
        return None
    return [results[i] for i in sorted(results)]


class StreamUsage(msgspec.Struct):
    """Running token counts of a streamed job, per candidate number."""

    completion_tokens: dict[int, int] = msgspec.field(default_factory=dict)
    cached_tokens: dict[int, int] = msgspec.field(default_factory=dict)
    reasoning_tokens: dict[int, int] = msgspec.field(default_factory=dict)

    def forward(self, number: int, frame: TextFrame) -> list[bytes]:
        """`frame_loop`'s on_frame for OpenAI streams: counts the candidate's tokens and
        passes on the chunk postproc wrote for the frame."""
        self.completion_tokens[number] = frame.num_output_tokens
        if frame.num_reasoning_tokens is not None:
            self.reasoning_tokens[number] = frame.num_reasoning_tokens
        if frame.num_cached_tokens is not None:
            self.cached_tokens[number] = frame.num_cached_tokens
        return [frame.chunk] if frame.chunk else []


async def sse_stream(ctx: ServingContext, job: Job, frames: Frames, opening: list[bytes],
                     include_usage: bool, usage_chunk):
    """SSE bytes of a streamed job: the opening chunks, each frame's ready-made chunk (written
    by postproc), an error event if a candidate fails, the usage chunk, `[DONE]` (O-1)."""
    for chunk in opening:
        yield chunk
    usage = StreamUsage()
    try:
        async with aclosing(frame_loop(frames, usage.forward)) as chunks:
            async for chunk in chunks:
                yield chunk
    except APIError as error:  # an error frame: the stream ends with an error event
        yield sse_event(error_body(error.status, error.message))
    if include_usage:
        completion = sum(usage.completion_tokens.values())
        reasoning = sum(usage.reasoning_tokens.values()) if usage.reasoning_tokens else None
        yield usage_chunk(job_usage(ctx, job, completion, usage.cached_tokens, reasoning))
    yield b"data: [DONE]\n\n"
