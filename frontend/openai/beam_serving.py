"""`use_beam_search` answers for chat completions and completions: each prompt's n best
beams (`frontend.pipeline.beam_job`) as choices, best first, whole (beam search cannot
stream). A beam's text is its tokens decoded; the choice's content is that text as is (no
reasoning or tool-call parser reads a beam: the search ranks whole token sequences), cut at
a stop string where one ended it.
"""

from __future__ import annotations

import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.pipeline.beam_job import BeamJob, run_beam_job, start_beam_job
from frontend.pipeline.beam_search import Beam
from frontend.pipeline.beam_stops import BeamStops
from frontend.pipeline.serving_context import ServingContext
from postproc.openai_shapes import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    Usage,
    chat_logprobs,
    completion_logprobs,
)

_json = msgspec.json.Encoder()


async def beam_chat_completion(ctx: ServingContext, http: Request,
                               request: ChatCompletionRequest, role: str) -> Response:
    job = await start_beam_job(ctx, request, "chatcmpl")
    created = int(time.time())
    if not await run_beam_job(ctx, http, job):
        return Response(status_code=499)  # the client left; nobody reads this
    choices = []
    for i, (p, beam) in enumerate(_returned(job, request.n)):
        text, finish, stop_reason = await _beam_text(ctx, request, beam, job.searches[p].stops)
        choices.append(ChatChoice(
            index=i, message=AssistantMessage(role=role, content=text),
            finish_reason=finish, stop_reason=stop_reason,
            logprobs=(chat_logprobs(_entries(job, beam))
                      if job.answer_logprobs is not None else None),
            token_ids=beam.tokens if request.return_token_ids else None,
        ))
    body = ChatCompletion(job.request_id, created, job.model, choices, _usage(job, request.n))
    if request.return_token_ids:
        body.prompt_token_ids = job.prompts[0].tokens.ids
    return Response(_json.encode(body), media_type="application/json")


async def beam_completion(ctx: ServingContext, http: Request,
                          request: CompletionRequest) -> Response:
    job = await start_beam_job(ctx, request, "cmpl")
    created = int(time.time())
    if request.echo:
        for prompt in job.prompts:
            if prompt.source_text is None:  # token ids echo as what they decode to
                prompt.source_text = await ctx.tokenization.decode(
                    prompt.tokens.ids, skip_special_tokens=False)
    if not await run_beam_job(ctx, http, job):
        return Response(status_code=499)
    choices = []
    for i, (p, beam) in enumerate(_returned(job, request.n)):
        text, finish, stop_reason = await _beam_text(ctx, request, beam, job.searches[p].stops)
        echo = (job.prompts[p].source_text or "") if request.echo else ""
        logprobs = (completion_logprobs(_entries(job, beam), start_offset=0)
                    if job.answer_logprobs is not None else None)
        choice = CompletionChoice(i, echo + text, finish, stop_reason, logprobs)
        if request.return_token_ids:
            choice.prompt_token_ids, choice.token_ids = job.prompts[p].tokens.ids, beam.tokens
        choices.append(choice)
    body = Completion(job.request_id, created, job.model, choices, _usage(job, request.n))
    return Response(_json.encode(body), media_type="application/json")


def _returned(job: BeamJob, n: int) -> list[tuple[int, Beam]]:
    """(prompt number, beam) of the choices: each prompt's n best beams, best first."""
    return [(p, beam) for p, beams in enumerate(job.beams) for beam in beams[:n]]


async def _beam_text(ctx: ServingContext, request, beam: Beam, stops: BeamStops | None
                     ) -> tuple[str, str, int | str | None]:
    """(text, finish_reason, stop_reason): a stop id is "stop" (stop_reason names a
    stop_token_ids id; EOS leaves it null, as vLLM), a stop string "stop" naming it (the
    text cut there, `beam_stops`), else "length". The stop token stays out of the text
    unless include_stop_str_in_output, as on the sampling path."""
    ids = beam.tokens
    if beam.stop_string is not None and stops is not None:
        return (await stops.cut(ctx, ids))[0], "stop", beam.stop_string
    if not beam.stopped:
        return await ctx.tokenization.decode(ids, request.skip_special_tokens), "length", None
    last = ids[-1]
    if not request.include_stop_str_in_output:
        ids = ids[:-1]
    text = await ctx.tokenization.decode(ids, request.skip_special_tokens)
    eos = () if request.ignore_eos else ctx.tokenization.settings.eos_token_ids
    named = last in (request.stop_token_ids or ()) and last not in eos  # EOS is checked first
    return text, "stop", last if named else None


def _entries(job: BeamJob, beam: Beam):
    """The beam's logprob entries with as many alternatives as the request asked."""
    k = job.answer_logprobs or 0
    return [msgspec.structs.replace(e, top=e.top[:k]) for e in beam.entries]


def _usage(job: BeamJob, n: int) -> Usage:
    """completion_tokens counts the returned beams' tokens (as vLLM's beam search)."""
    completion = sum(len(beam.tokens) for _, beam in _returned(job, n))
    prompt = job.num_prompt_tokens
    return Usage(prompt, completion, prompt + completion)
