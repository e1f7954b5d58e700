"""Background responses (`background: true`): run to completion with no client waiting.

The frontend that accepts one stores it `in_progress`, takes its lease in the state store
and runs it in a task here; every `LEASE_S / 3` the task renews the lease and looks for a
cancel asked on any frontend. At the end it writes the finished response over the record,
retrying while the store is away. If this frontend dies, the lease runs out; the next
frontend that reads the record (a poll), or whose sweep (`sweep`, every lease period) finds
it, takes the lease and runs the request again from its start (`responses_api._resume`), so
it completes with no client and no poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable

from frontend.base.errors import APIError
from frontend.pipeline.protocol_edge import Outcome
from frontend.responses.stored import LEASE_S, ResponseRecords, StoredResponse
from frontend.state.store import StoreUnavailable

log = logging.getLogger("sluice.frontend.background")
FINAL_WRITE_RETRY_S = 300.0  # how long a finished response waits for an absent store

# What to store when the run ends: from its outcome, or from the error that ended it.
Finish = Callable[[Outcome | None, APIError | None], StoredResponse]
# What follows once the record is written (the conversation's items, the last events).
Done = Callable[[StoredResponse], Awaitable[None]]


class NoClient:
    """Stands in for the HTTP request of a background response: nobody waits on it, so it
    never disconnects (pipeline.job_frames watches the request for that)."""

    async def receive(self) -> dict:
        await asyncio.Event().wait()
        return {}


class BackgroundRunner:
    """This frontend's background responses, each an asyncio task."""

    def __init__(self, records: ResponseRecords) -> None:
        self.records = records
        self.holder = uuid.uuid4().hex  # this frontend, as a lease holder
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, response_id: str, run: Awaitable[Outcome], finish: Finish,
              done: Done) -> None:
        """Runs `run` (the answer, its events stored as they come) with the lease kept."""
        task = asyncio.create_task(self._run(response_id, run, finish, done))
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    async def take_over_if_lapsed(self, stored: StoredResponse,
                                  run_again: Callable[[], Awaitable[None]]) -> None:
        """On reading an unfinished background response: if nobody holds its lease (its
        runner died), take the lease and run it again here."""
        response_id = stored.response.id
        if (stored.chat is None or stored.response.status not in ("queued", "in_progress")
                or response_id in self._tasks):
            return
        if await self.records.cancel_asked(response_id):
            return
        if await self.records.lease(response_id, self.holder):
            await run_again()

    async def _run(self, response_id: str, run: Awaitable[Outcome], finish: Finish,
                   done: Done) -> None:
        gathering = asyncio.ensure_future(run)
        try:
            while not gathering.done():
                await asyncio.wait({gathering}, timeout=LEASE_S / 3)
                if gathering.done():
                    break
                try:
                    if (await self.records.cancel_asked(response_id)
                            or not await self.records.lease(response_id, self.holder)):
                        gathering.cancel()  # closes the frames: the engine aborts it
                        return
                except StoreUnavailable:
                    continue  # keep generating; the final write waits for the store
            try:
                stored = finish(gathering.result(), None)
            except APIError as error:
                stored = finish(None, error)
            if await self._write(response_id, stored):
                await done(stored)
        except asyncio.CancelledError:
            gathering.cancel()
            raise
        except Exception:
            log.exception("background response %s failed", response_id)
        finally:
            with contextlib.suppress(BaseException):
                await gathering

    async def _write(self, response_id: str, stored: StoredResponse) -> bool:
        """Writes the finished record; False when a cancel wrote it or it was lost."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINAL_WRITE_RETRY_S
        while True:
            try:
                if await self.records.cancel_asked(response_id):
                    return False  # the cancel wrote the record already
                if not await self.records.put(stored):
                    log.warning("background response %s is too large to store", response_id)
                await self.records.finished(response_id)
                return True
            except StoreUnavailable:
                if loop.time() > deadline:
                    log.error("background response %s lost: the store stayed away",
                              response_id)
                    return False
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        """Shutdown: stop running; the leases run out and another frontend takes over."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def sweep(self, resume: Callable[[StoredResponse], Awaitable[None]]) -> None:
        """Forever, every lease period (jittered, so frontends do not sweep in step): take
        over the unfinished background responses whose runner died."""
        while True:
            await asyncio.sleep(LEASE_S * random.uniform(0.8, 1.2))
            try:
                for stored in await self.records.unfinished():
                    await self.take_over_if_lapsed(stored, lambda s=stored: resume(s))
            except StoreUnavailable:
                continue
            except Exception:
                log.exception("the background sweep failed")
