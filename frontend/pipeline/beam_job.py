"""A `use_beam_search` request from checks to finished beams: the beam path beside
`pipeline.start_job`, which the OpenAI faces take when the request asks for it.

It shares the pipeline's checks (`check_request`, where `beam_checks` refuses what cannot
combine), its input stage and its plan (so every range is checked as for any request),
then runs one search per prompt (`beam_runner`), all at once.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
from starlette.requests import Request

from frontend.base.api_models import ChatCompletionRequest, CompletionRequest
from frontend.base.errors import bad_request
from frontend.engine_client.lora_client import lora_name_for
from frontend.pipeline.beam_checks import beam_width
from frontend.pipeline.beam_runner import DISCONNECTED, BeamPrompt, ClientGone, run_search
from frontend.pipeline.beam_search import Beam, BeamSettings
from frontend.pipeline.beam_stops import BeamStops
from frontend.pipeline.input_stage import PromptInput, chat_input, completion_inputs
from frontend.pipeline.sampling import (
    check_request,
    prompt_max_tokens,
    prompt_params,
    request_plan,
)
from frontend.pipeline.serving_context import (
    ServingContext,
    check_model,
    max_model_len,
    structured_settings,
)

Request_ = ChatCompletionRequest | CompletionRequest


class BeamJob(msgspec.Struct):
    request_id: str
    model: str
    prompts: list[PromptInput]
    searches: list[BeamPrompt]  # one per prompt
    answer_logprobs: int | None  # alternatives per token in the answer; None: no logprobs
    beams: list[list[Beam]] = []  # per prompt, best first (filled by `run_beam_job`)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(p.num_tokens for p in self.prompts)


async def start_beam_job(ctx: ServingContext, request: Request_, prefix: str) -> BeamJob:
    """Checks and reads the request (renders a chat) and plans its searches; no engine work."""
    check_model(ctx, request.model)
    check_request(request, structured_settings(ctx), ctx.limits)
    if isinstance(request, ChatCompletionRequest):
        endpoint, prompts = "chat", [await chat_input(ctx, request)]
    else:
        endpoint, prompts = "completions", await completion_inputs(ctx, request)
    if any(c.stats is not None and c.stats.speculative for c in ctx.client.live_engines()):
        raise bad_request("use_beam_search cannot be combined with speculative decoding, "
                          "which this server's engine runs", "use_beam_search")
    if any(p.images for p in prompts):
        raise bad_request("images cannot be combined with use_beam_search", "messages")
    plan = request_plan(request, vocab_size=ctx.vocab_size, defaults=ctx.generation_defaults)
    limit = max_model_len(ctx)
    request_id = f"{prefix}-{request.request_id or uuid.uuid4().hex}"
    lora_name = lora_name_for(ctx, request.model)
    stop_ids = frozenset(plan.params.stop_token_ids)
    if not request.ignore_eos:
        stop_ids |= frozenset(ctx.tokenization.settings.eos_token_ids)
    answer_logprobs = _answer_logprobs(request)
    out = plan.output  # the stop strings as the sampling path's postproc gets them
    stops = (BeamStops(out.stop, out.include_stop_str_in_output, out.min_tokens,
                       out.skip_special_tokens) if out.stop else None)
    searches = []
    for p, prompt in enumerate(prompts):
        max_tokens = prompt_params(plan, prompt_max_tokens(
            request, endpoint, prompt.num_tokens, limit, ctx.generation_defaults)).max_tokens
        settings = _settings(request, max_tokens, stop_ids, plan.params.min_tokens)
        searches.append(BeamPrompt(
            request_id=f"{request_id}-beam{p}", prompt_ids=prompt.tokens.ids,
            settings=settings, num_top=max(settings.num_top, answer_logprobs or 0),
            reply_to=ctx.client.result_address, cache_salt=request.cache_salt,
            priority=request.priority, lora_name=lora_name,
            tokens_as_ids=bool(request.return_tokens_as_token_ids
                               or ctx.output.return_tokens_as_token_ids), stops=stops))
    _check_logprobs_cap(ctx, request, searches[0].num_top)
    return BeamJob(request_id, lora_name or ctx.model_name, prompts, searches, answer_logprobs)


def _answer_logprobs(request: Request_) -> int | None:
    """The alternatives per token the answer shows (the plan may ask more for best_of)."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs is True else None
    return request.logprobs


def _settings(request: Request_, max_tokens: int, stop_ids: frozenset[int],
              min_tokens: int) -> BeamSettings:
    width, _ = beam_width(request)
    return BeamSettings(width=width, max_tokens=max_tokens,
                        length_penalty=request.length_penalty,
                        early_stopping=request.early_stopping, stop_ids=stop_ids,
                        min_tokens=min_tokens)


def _check_logprobs_cap(ctx: ServingContext, request: Request_, num_top: int) -> None:
    """Each step asks the engine for (1 + stop ids) * width alternatives per beam."""
    cap = ctx.limits.max_logprobs
    if num_top > cap:
        width, field = beam_width(request)
        raise bad_request(f"beam search with {width} beams needs {num_top} logprobs per step "
                          f"and this server allows {cap} (--max-logprobs)", field)


async def run_beam_job(ctx: ServingContext, http: Request, job: BeamJob) -> bool:
    """Runs every prompt's search at once; False when the client left first."""
    queues = [asyncio.Queue() for _ in job.searches]
    watcher = asyncio.create_task(_watch_disconnect(http, queues))
    tasks = [asyncio.create_task(run_search(ctx, s, q))
             for s, q in zip(job.searches, queues, strict=True)]
    try:
        job.beams = await asyncio.gather(*tasks)
        return True
    except ClientGone:
        return False
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()  # a sibling failed or the client left: stop the others' steps
        await asyncio.gather(*tasks, return_exceptions=True)


async def _watch_disconnect(http: Request, queues: list[asyncio.Queue]) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            for queue in queues:
                queue.put_nowait(DISCONNECTED)
            return
