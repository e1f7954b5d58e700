"""A response's event stream: response.created, in_progress, each item's events, then the
final one (response.completed, incomplete or failed)."""

from __future__ import annotations

from contextlib import aclosing

import msgspec

from frontend.base.errors import APIError
from frontend.pipeline.protocol_edge import Blocks, block_events
from frontend.responses.shaping import Shaper, failed_response
from frontend.state.store import StoreUnavailable


async def response_events(shaper: Shaper, frames, blocks: Blocks):
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


async def stream_events(shaper: Shaper, frames, remember):
    blocks = Blocks()
    try:
        async with aclosing(response_events(shaper, frames, blocks)) as events:
            async for chunk in events:
                yield chunk
    except APIError as error:
        yield shaper.error(error)
        yield shaper.lifecycle("response.failed", failed_response(shaper, error, blocks))
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
