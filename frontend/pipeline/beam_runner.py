"""Beam search driven from the frontend, as vLLM's serving layer drives it.

Each step sends every running beam to the engine as a one-token greedy request over the
prompt plus that beam's tokens, asking the `num_top` best alternatives with their logprobs,
and hands the answers to `BeamSearch` (`beam_search.py`), which ranks, ends and keeps beams.
Beams share their KV pages through the engine's prefix cache: a beam's request finds every
full page of its prompt and of the tokens it shares with its siblings already cached (the
page hashes chain over all tokens before them), so only the last, partly filled page is
computed again, the copy a fork would make. The engine keeps no state between steps, so a
request that ends (or a client that leaves) leaves no page owned.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from frontend.base.errors import APIError
from frontend.engine_client.client import EngineUnavailable
from frontend.pipeline.beam_search import Beam, BeamSearch, BeamSettings
from frontend.pipeline.beam_stops import BeamStops
from frontend.pipeline.serving_context import ServingContext, frame_error
from shared.protocol import (
    EngineRequest,
    LogprobEntry,
    OutputParams,
    SamplingParams,
    TextFrame,
    pack_ids,
)

DISCONNECTED = object()  # queue sentinel: the client went away


class ClientGone(Exception):
    """The client left mid-search; nobody reads the answer."""


class BeamPrompt(msgspec.Struct, frozen=True):
    """One prompt's search: its ids and what every step's engine request shares."""

    request_id: str  # step requests are `<request_id>-<step>-<beam>`
    prompt_ids: list[int]
    settings: BeamSettings
    num_top: int  # alternatives per step: the search's, or the answer's logprobs if more
    reply_to: str
    cache_salt: str | None = None
    priority: int = 0
    lora_name: str | None = None
    tokens_as_ids: bool = False
    stops: BeamStops | None = None  # the request's stop strings (beam_stops.py)


async def run_search(ctx: ServingContext, prompt: BeamPrompt, queue: asyncio.Queue
                     ) -> list[Beam]:
    """The prompt's finished beams, best first (at most width). `queue` receives the step
    requests' frames, and DISCONNECTED when the client leaves (then ClientGone)."""
    search = BeamSearch(prompt.settings)
    step = 0
    while not search.done:
        grown = search.candidates(await _step(ctx, prompt, search.running, step, queue))
        text_stops = None
        if prompt.stops is not None:
            text_stops = await prompt.stops.matches(ctx, grown, prompt.settings.stop_ids)
        search.take(grown, text_stops)
        step += 1
    return search.finished


def _step_request(prompt: BeamPrompt, beam: Beam, request_id: str) -> EngineRequest:
    # Greedy with ignore_eos: one token whatever it is; the search decides what ends.
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                            logprobs=prompt.num_top)
    return EngineRequest(
        request_id=request_id, prompt_token_ids=pack_ids(prompt.prompt_ids + beam.tokens),
        params=params, reply_to=prompt.reply_to, arrival_time=time.time(),
        output=OutputParams(logprobs=True, tokens_as_ids=prompt.tokens_as_ids),
        cache_salt=prompt.cache_salt, priority=prompt.priority, lora_name=prompt.lora_name,
    )


async def _step(ctx: ServingContext, prompt: BeamPrompt, beams: list[Beam], step: int,
                queue: asyncio.Queue) -> list[LogprobEntry]:
    """Every running beam's next-token entry, in beam order."""
    ids = [f"{prompt.request_id}-{step}-{b}" for b in range(len(beams))]
    entries: dict[str, LogprobEntry] = {}
    pending = set()
    try:
        for request_id, beam in zip(ids, beams, strict=True):
            request = _step_request(prompt, beam, request_id)
            pending.add(request_id)
            await ctx.client.submit(request, prompt.prompt_ids + beam.tokens, queue)
        while pending:
            frame = await queue.get()
            if frame is DISCONNECTED:
                raise ClientGone
            _take(frame, entries, pending)
    except EngineUnavailable as exc:
        raise APIError(503, str(exc)) from exc
    finally:
        for request_id in pending:
            await ctx.client.abort(request_id)
        for request_id in ids:
            ctx.client.release(request_id)
    return [entries[request_id] for request_id in ids]


def _take(frame: TextFrame, entries: dict[str, LogprobEntry], pending: set[str]) -> None:
    if frame.finish_reason == "error":
        raise frame_error(frame)
    if frame.logprobs:
        entries[frame.request_id] = frame.logprobs[0]
    if frame.finish_reason is not None:
        pending.discard(frame.request_id)
        if frame.request_id not in entries:
            raise APIError(500, "the engine answered a beam step without logprobs")
