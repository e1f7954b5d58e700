"""The OpenAI routes: chat completions, completions, /tokenize and /detokenize.

Route handlers stay thin; the shared pipeline (`frontend.pipeline.pipeline`) checks, renders and
submits a request and yields its frames, and this module shapes them into OpenAI bodies
or SSE chunks, streaming or not. A request with n > 1 or best_of returns its chosen
candidates as choices; one with use_beam_search its best beams (`beam_serving`).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from frontend.base.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from frontend.base.errors import bad_request
from frontend.input.budgets import BudgetError, TokenizeParams
from frontend.input.input_bounds import check_bounds
from frontend.openai.beam_serving import beam_chat_completion, beam_completion
from frontend.pipeline.input_stage import _render as render_messages
from frontend.pipeline.job import Candidate, Job
from frontend.pipeline.pipeline import (
    collect_candidates,
    job_usage,
    sse_stream,
    start_job,
    stream_usage,
)
from frontend.pipeline.serving_context import (
    ServingContext,
    check_model,
    max_model_len,
    sse_response,
)
from postproc.chunks import sse_event
from postproc.openai_shapes import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    DetokenizeResponse,
    TokenizeResponse,
    Usage,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
    reasoning_delta,
)
from postproc.tool_parsers import ToolDelta, collect

_json = msgspec.json.Encoder()


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


def _usage(ctx: ServingContext, job: Job, candidates: list[Candidate]) -> Usage:
    completion = sum(c.last.num_output_tokens for c in candidates)
    counted = [c.reasoning_tokens for c in candidates if c.reasoning_tokens is not None]
    return job_usage(ctx, job, completion,
                     {i: c.num_cached_tokens for i, c in enumerate(candidates)},
                     sum(counted) if counted else None)


# ---------------------------------------------------------------- chat


async def chat_completion(
    ctx: ServingContext, http: Request, request: ChatCompletionRequest
) -> Response:
    if request.use_beam_search:
        return await beam_chat_completion(ctx, http, request, answer_role(ctx, request))
    job, frames = await start_job(ctx, http, request)
    if request.stream:
        return sse_response(_chat_stream(ctx, request, job, frames))
    candidates = await collect_candidates(frames)
    if candidates is None:
        return Response(status_code=499)  # the client left; nobody reads this
    want_logprobs = job.plan.params.logprobs is not None
    role = answer_role(ctx, request)
    echo = _echoed(request, role)
    choices = [
        ChatChoice(
            index=i,
            message=_message(ctx, c, role, echo),
            finish_reason=c.last.finish_reason,
            stop_reason=c.last.stop_reason,
            logprobs=chat_logprobs(c.logprobs) if want_logprobs else None,
            token_ids=c.token_ids if request.return_token_ids else None,
        )
        for i, (_, c) in enumerate(_chosen(job, candidates))
    ]
    body = ChatCompletion(job.request_id, job.created, job.model, choices,
                          _usage(ctx, job, candidates))
    if request.return_token_ids:
        body.prompt_token_ids = job.prompts[0].tokens.ids
    if request.prompt_logprobs is not None:
        body.prompt_logprobs = prompt_logprobs(candidates[0].prompt_logprobs or [])
    return Response(_json.encode(body), media_type="application/json")


def answer_role(ctx: ServingContext, request: ChatCompletionRequest) -> str:
    """The role a chat answer carries, as vLLM: --response-role after a generation prompt,
    else that of the last message, which the output continues."""
    if request.add_generation_prompt or not request.messages:
        return ctx.output.response_role
    return request.messages[-1].role


def _echoed(request: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's text goes before the answer when the answer
    continues it (the message has the answer's role, as with continue_final_message)."""
    if not request.echo or not request.messages or request.messages[-1].role != role:
        return ""
    content = request.messages[-1].content
    if isinstance(content, list):
        return "\n".join(part.text or "" for part in content if part.type == "text")
    return content or ""


def _message(ctx: ServingContext, c: Candidate, role: str, echo: str) -> AssistantMessage:
    calls = collect([ToolDelta("", c.tool_calls)]).calls if c.tool_calls else []
    text = echo + c.text
    return AssistantMessage(
        role=role,
        content=(text or None) if calls else text,
        tool_calls=calls or None,
        **reasoning_delta(ctx.output.reasoning_field, "".join(c.reasoning)),
    )


def _chat_stream(ctx: ServingContext, request: ChatCompletionRequest, job: Job, frames):
    include_usage, continuous = stream_usage(ctx, request)

    def chunk(choices, usage=None, prompt_ids=UNSET) -> bytes:
        return sse_event(ChatCompletionChunk(job.request_id, job.created, job.model,
                                             choices, usage, prompt_token_ids=prompt_ids))

    prompt_tokens = job.num_prompt_tokens
    opening_usage = Usage(prompt_tokens, 0, prompt_tokens) if continuous else None
    role = answer_role(ctx, request)
    # With return_token_ids each choice's opening chunk names the prompt's ids, as vLLM.
    prompt_ids = job.prompts[0].tokens.ids if request.return_token_ids else UNSET
    opening = [chunk([ChatChunkChoice(i, Delta(role=role))], opening_usage, prompt_ids)
               for i in range(job.plan.n)]
    if echo := _echoed(request, role):  # each choice's echoed text, before its answer
        opening += [chunk([ChatChunkChoice(i, Delta(content=echo))], opening_usage)
                    for i in range(job.plan.n)]
    return sse_stream(ctx, job, frames, opening, include_usage,
                      lambda usage: chunk([], usage))


# ---------------------------------------------------------------- completions


async def completion(ctx: ServingContext, http: Request, request: CompletionRequest) -> Response:
    if request.use_beam_search:
        return await beam_completion(ctx, http, request)
    job, frames = await start_job(ctx, http, request)
    if request.stream:
        include_usage, _ = stream_usage(ctx, request)

        def usage_chunk(usage: Usage) -> bytes:
            return sse_event(Completion(job.request_id, job.created, job.model, [], usage))

        return sse_response(sse_stream(ctx, job, frames, [], include_usage, usage_chunk))
    candidates = await collect_candidates(frames)
    if candidates is None:
        return Response(status_code=499)
    choices = []
    for i, (p, c) in enumerate(_chosen(job, candidates)):
        echo = (job.prompts[p].source_text or "") if request.echo else ""
        logprobs = None
        if job.plan.params.logprobs is not None and request.logprobs is not None:
            # prompt_logprobs may have asked the engine for more alternatives than echo.
            echoed = [msgspec.structs.replace(e, top=e.top[:request.logprobs])
                      for e in c.prompt_logprobs or []] if request.echo else []
            logprobs = completion_logprobs(echoed + c.logprobs, start_offset=0)
        choice = CompletionChoice(i, echo + c.text, c.last.finish_reason, c.last.stop_reason,
                                  logprobs)
        if request.return_token_ids:
            choice.prompt_token_ids, choice.token_ids = job.prompts[p].tokens.ids, c.token_ids
        if request.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs(c.prompt_logprobs or [])
        choices.append(choice)
    body = Completion(job.request_id, job.created, job.model, choices,
                      _usage(ctx, job, candidates))
    return Response(_json.encode(body), media_type="application/json")


# ---------------------------------------------------------------- /tokenize, /detokenize


async def tokenize(ctx: ServingContext, request: TokenizeRequest) -> TokenizeResponse:
    """vLLM's /tokenize: the ids a prompt (or rendered messages) would have, under the same
    budgets as a generation request, so a text too long to serve is a 400 here too."""
    check_model(ctx, request.model)
    limit = max_model_len(ctx)
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
    rendered_ids = None
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
        # The template already holds BOS, so no special tokens by default (req T-4).
        rendered = await render_messages(ctx, chat)
        text, field, add_special = rendered.text, "messages", False
        rendered_ids = rendered.token_ids  # set when the renderer tokenized (mistral-common)
    if request.add_special_tokens is not None:
        add_special = request.add_special_tokens
    params = TokenizeParams(max_total_tokens=limit, add_special_tokens=add_special)
    try:
        tokens = (await ctx.tokenization.fit_ids(rendered_ids, params) if rendered_ids is not None
                  else await ctx.tokenization.tokenize(text, params))
    except BudgetError as exc:
        raise bad_request(str(exc), exc.param or field) from exc
    strs = await ctx.tokenization.token_strs(tokens.ids) if request.return_token_strs else None
    return TokenizeResponse(count=len(tokens.ids), max_model_len=limit, tokens=tokens.ids,
                            token_strs=strs)


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
