"""Background responses (`background: true`): stored in_progress, run under a lease with
their events kept for streams and resumes, and run again by another frontend when the one
running them dies."""

from __future__ import annotations

import uuid
from contextlib import aclosing

import msgspec

from frontend.base.api_models import ChatCompletionRequest
from frontend.base.errors import APIError
from frontend.pipeline import pipeline
from frontend.pipeline.protocol_edge import Blocks, Outcome, renamed
from frontend.pipeline.serving_context import ServingContext
from frontend.responses import events as event_log
from frontend.responses.background import NoClient
from frontend.responses.chat_request import FIELD_NAMES
from frontend.responses.event_stream import response_events
from frontend.responses.events import EventLog
from frontend.responses.models import ResponseError, ResponseObject
from frontend.responses.shaping import Shaper, answer_message, failed_response
from frontend.responses.shared import Responses, add_to_conversation
from frontend.responses.stored import StoredResponse


async def start_background(ctx: ServingContext, responses: Responses, record: StoredResponse,
                             chat: ChatCompletionRequest) -> ResponseObject:
    """Stores the response in_progress (so any frontend sees it), takes its lease and runs
    it here; a request the checks refuse is a 4xx now, and nothing stays stored."""
    records, response_id = responses.records, record.response.id
    record = msgspec.structs.replace(record, chat=chat)
    if not await records.put(record):
        raise APIError(413, "the request is larger than the state store keeps", "input")
    await records.lease(response_id, responses.runner.holder)
    await records.mark_unfinished(record)  # after the lease: a sweep finds it held
    try:
        await run_background(ctx, responses, record)
    except APIError:
        await records.delete(response_id, record.owner)
        await records.finished(response_id)
        raise
    return record.response


async def run_background(ctx: ServingContext, responses: Responses, record: StoredResponse
                          ) -> None:
    try:
        job, frames = await pipeline.start_job(ctx, NoClient(), record.chat, prefix="resp")
    except APIError as exc:
        raise renamed(exc, FIELD_NAMES) from exc
    shaper = Shaper(record.response, record.hex, job.num_prompt_tokens)
    records = responses.records
    kept = EventLog(records.store, record.response.id, records.ttl_s,
                    records.store.max_value_bytes)
    blocks = Blocks()

    async def run() -> Outcome:
        """The answer, its events stored as they are made (for streams and resumes)."""
        try:
            async with aclosing(response_events(shaper, frames, blocks)) as events:
                async for event in events:
                    kept.add(event)
                    await kept.flush(force=len(kept.events) <= 2)  # response.created at once
        except APIError as error:
            kept.add(shaper.error(error))
            raise
        return blocks.outcome()

    def finish(outcome: Outcome | None, error: APIError | None) -> StoredResponse:
        if error is not None:
            response = failed_response(shaper, error, blocks)
            kept.add(shaper.lifecycle("response.failed", response))
            return msgspec.structs.replace(record, response=response, chat=None)
        response = shaper.final(outcome)
        if response.status in ("completed", "incomplete"):
            kept.add(shaper.lifecycle(f"response.{response.status}", response))
        return msgspec.structs.replace(
            record, response=response, chat=None,
            conversation=[*record.conversation, answer_message(outcome.blocks)])

    async def done(stored: StoredResponse) -> None:
        try:
            await add_to_conversation(responses, stored, stored.response)
        finally:  # the final event last: a follower then finds the rest done
            await kept.flush(force=True)

    responses.runner.start(record.response.id, run(), finish, done)


async def resume(ctx: ServingContext, responses: Responses, stored: StoredResponse) -> None:
    """Runs a background response again whose runner died; a refusal now marks it failed."""
    # A new engine request id: the dead frontend's request may still be in the engine.
    chat = msgspec.structs.replace(stored.chat, request_id=uuid.uuid4().hex)
    # Its events start again from 0: none of the first run's may outlast the new ones.
    await event_log.forget(responses.records.store, stored.response.id)
    try:
        await run_background(ctx, responses, msgspec.structs.replace(stored, chat=chat))
    except APIError as error:
        failed = msgspec.structs.replace(stored.response, status="failed",
                                         error=ResponseError("server_error", error.message))
        await responses.records.put(msgspec.structs.replace(stored, response=failed, chat=None))
        await responses.records.finished(stored.response.id)


async def sweep(ctx: ServingContext, responses: Responses) -> None:
    """This frontend's share of running background responses whose frontend died."""
    await responses.runner.sweep(lambda stored: resume(ctx, responses, stored))


def follow(responses: Responses, response: ResponseObject, owner: str, after: int,
            ctx: ServingContext | None = None):
    """The stored events after `after`, then the live ones until the response ends; with
    `ctx`, a follower whose response's runner died takes it over, as a poll would."""
    async def finished() -> bool:
        stored = await responses.records.get(response.id, owner)
        if stored is not None and stored.chat is not None and ctx is not None:
            await responses.runner.take_over_if_lapsed(
                stored, lambda: resume(ctx, responses, stored))
        return stored is None or stored.response.status not in ("queued", "in_progress")

    return event_log.follow(responses.records.store, response.id, after, finished)
