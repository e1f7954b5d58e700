"""Runs batches: each line through the same route handler an interactive request meets.

A frontend runs at most `--max-running-batches` batches at once and at most
`--max-batch-lines-in-flight` of their lines at once (all its batches together), so the
engines' batch never holds more than that many sequences per frontend for batch work, and
each line asks for the engine's lowest priority (`BATCH_PRIORITY`, first come under the
default `fcfs` policy; behind interactive requests under `--scheduling-policy priority`).

A batch is claimed under a lease in the store (`batch-lease:{id}`), renewed every
`LEASE_S / 3`; each finished line is written to the store at once (`batch-result:`). When
the frontend running a batch dies, its lease runs out and the next sweep (every lease
period, on every frontend) takes the batch over and runs the lines that have no result yet.
A cancel asked on any frontend is seen at the next renewal: the lines in flight are aborted
and the batch is finalized with what finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

import msgspec

from frontend.batches.models import (
    BatchErrorData,
    BatchErrors,
    InputLine,
    LineError,
    LineResponse,
    LineResult,
    OutputLine,
    StoredBatch,
)
from frontend.batches.records import LEASE_S, BatchRecords, FileRecords
from frontend.state.store import StoreUnavailable, ValueTooLarge

log = logging.getLogger("sluice.frontend.batches")

# The engine's queue order under --scheduling-policy priority is lower first: batch lines go
# after every interactive request that did not ask for a priority of its own.
BATCH_PRIORITY = 2**31
PRIORITIZED = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")  # take `priority`
# (status, body) of one request run through its route, as the route answers it.
Dispatch = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]
# The owner of the batch whose line `dispatch` runs (its line tasks inherit it), so the
# dispatch can draw the line from its key's budget (--api-keys-file).
line_owner: ContextVar[str | None] = ContextVar("sluice_batch_owner", default=None)
_decode_line = msgspec.json.Decoder(InputLine)
_encode = msgspec.json.Encoder().encode


def split_lines(content: bytes) -> list[bytes]:
    """A JSONL file's requests: its lines, blank ones left out."""
    return [line for line in content.split(b"\n") if line.strip()]


def _custom_id_of(raw: bytes) -> str | None:
    with contextlib.suppress(Exception):
        value = msgspec.json.decode(raw)
        if isinstance(value, dict) and isinstance(value.get("custom_id"), str):
            return value["custom_id"]
    return None


def _error_line(custom_id: str | None, code: str, message: str) -> LineResult:
    return LineResult(False, OutputLine(f"batch_req_{uuid.uuid4().hex}", custom_id, None,
                                        LineError(code, message)))


def plan_lines(lines: list[bytes], endpoint: str) -> list[InputLine | LineResult]:
    """Each line read: the request to run, or the error-file entry it is instead (bad JSON,
    a wrong shape, another endpoint, a repeated custom_id, a stream)."""
    seen: set[str] = set()
    out: list[InputLine | LineResult] = []
    for number, raw in enumerate(lines, 1):
        try:
            line = _decode_line.decode(raw)
        except msgspec.DecodeError as exc:
            code = "invalid_request" if isinstance(exc, msgspec.ValidationError) else \
                "invalid_json_line"
            out.append(_error_line(_custom_id_of(raw), code, f"line {number}: {exc}"))
            continue
        problem = None
        if line.method != "POST":
            problem = ("invalid_method", f"line {number}: method must be POST")
        elif line.url != endpoint:
            problem = ("invalid_url", f"line {number}: url {line.url!r} is not this batch's "
                                      f"endpoint {endpoint!r}")
        elif line.custom_id in seen:
            problem = ("duplicate_custom_id",
                       f"line {number}: custom_id {line.custom_id!r} is used by an earlier line")
        elif line.body.get("stream"):
            problem = ("invalid_request", f"line {number}: stream is not supported in a batch")
        seen.add(line.custom_id)
        out.append(_error_line(line.custom_id, *problem) if problem else line)
    return out


class BatchRunner:
    """This frontend's running batches, each an asyncio task."""

    def __init__(self, batches: BatchRecords, files: FileRecords, dispatch: Dispatch,
                 max_running: int, lines_in_flight: int) -> None:
        self.batches, self.files, self.dispatch = batches, files, dispatch
        self.max_running = max_running
        self.lines = asyncio.Semaphore(lines_in_flight)
        self.holder = uuid.uuid4().hex  # this frontend, as a lease holder
        self._tasks: dict[str, asyncio.Task] = {}
        self._claiming: asyncio.Task | None = None

    # ------------------------------------------------------------ claiming

    def kick(self) -> None:
        """Look for batches to run now (a batch created or cancelled here)."""
        if self._claiming is None or self._claiming.done():
            self._claiming = asyncio.create_task(self._claim_some())

    async def _claim_some(self) -> None:
        try:
            for batch_id in await self.batches.active():
                if batch_id in self._tasks:
                    continue
                if len(self._tasks) >= self.max_running:
                    break
                if await self.batches.lease(batch_id, self.holder):
                    task = asyncio.create_task(self._run(batch_id))
                    self._tasks[batch_id] = task
                    task.add_done_callback(lambda _, b=batch_id: self._tasks.pop(b, None))
        except StoreUnavailable:
            pass
        except Exception:
            log.exception("claiming batches failed")

    async def sweep(self) -> None:
        """Forever, every lease period (jittered): start batches nobody runs, new ones and
        those whose frontend died."""
        while True:
            await asyncio.sleep(LEASE_S * random.uniform(0.8, 1.2))
            await self._claim_some()

    async def stop(self) -> None:
        """Shutdown: stop running; the leases run out and another frontend takes over."""
        tasks = list(self._tasks.values())
        if self._claiming is not None:
            tasks.append(self._claiming)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ running

    async def _run(self, batch_id: str) -> None:
        try:
            await self._run_batch(batch_id)
        except asyncio.CancelledError:
            raise
        except StoreUnavailable as exc:
            log.warning("batch %s paused: %s (a sweep resumes it)", batch_id, exc)
        except Exception:
            log.exception("batch %s failed", batch_id)

    async def _run_batch(self, batch_id: str) -> None:
        stored = await self.batches.get(batch_id, None)
        if stored is None or stored.batch.status not in ("validating", "in_progress",
                                                         "cancelling"):
            await self.batches.finished(batch_id, ())
            return
        batch = stored.batch
        source = await self.files.get(batch.input_file_id, None)
        content = None if source is None else await self.files.content(source)
        if content is None:
            batch.errors = BatchErrors([BatchErrorData(
                "file_not_found", "the input file was deleted or expired")])
            await self.finalize(stored, "failed", {})
            return
        planned = plan_lines(split_lines(content), batch.endpoint)
        results = await self.batches.results(batch_id)
        batch.request_counts.total = len(planned)
        if (at := await self.batches.cancel_asked(batch_id)) is not None:
            batch.cancelling_at = batch.cancelling_at or at
            await self.finalize(stored, "cancelled", results)
            return
        ending: list[str] = []  # why it stops early: cancelled, expired, lost
        if time.time() > batch.expires_at:  # it waited its whole window for a runner
            ending.append("expired")
        if batch.status == "validating":
            batch.status, batch.in_progress_at = "in_progress", int(time.time())
        await self._count(stored, results)
        stop = asyncio.Event()
        if ending:
            stop.set()
        await self._run_lines(batch_id, stored, planned, results, stop, ending)
        if ending and ending[0] == "lost":
            return  # another frontend holds it now
        status = ending[0] if ending else "completed"
        if status == "completed" and (at := await self.batches.cancel_asked(batch_id)):
            # A cancel that came after the keeper's last look: the record says cancelling,
            # and the client was told so; it ends cancelled, with every line it finished.
            status, batch.cancelling_at = "cancelled", batch.cancelling_at or at
        if status == "completed" and len(results) < len(planned):
            # A line whose result the store did not take: keep the batch unfinished; the
            # lease lapses and a sweep runs the missing lines again.
            log.warning("batch %s: %d lines have no stored result yet", batch_id,
                        len(planned) - len(results))
            return
        if status == "expired":
            _expire_the_rest(planned, results)
        await self.finalize(stored, status, results)

    async def _run_lines(self, batch_id: str, stored: StoredBatch, planned: list,
                         results: dict[int, LineResult], stop: asyncio.Event,
                         ending: list[str]) -> None:
        """Runs the lines that have no result yet (as many at once as `self.lines` lets this
        frontend's batches run) while the keeper holds the lease; returns when they are done
        or `stop` is set (`ending` then says why)."""
        keeper = asyncio.create_task(self._keep(stored, results, stop, ending))
        line_owner.set(stored.owner)  # for the line tasks made below
        running: set[asyncio.Task] = set()
        try:
            for index, item in enumerate(planned):
                if index in results:
                    continue
                if isinstance(item, LineResult):
                    await self._record(batch_id, index, item, results)
                    continue
                await _acquire_or_stop(self.lines, stop)
                if stop.is_set():
                    break
                task = asyncio.create_task(self._line(batch_id, index, item, results))
                running.add(task)
                # Here, not in the line's own finally: a task cancelled before it started
                # never runs its body.
                task.add_done_callback(lambda t: (running.discard(t), self.lines.release()))
            while running and not stop.is_set():
                await asyncio.wait(set(running), timeout=LEASE_S / 3)
        finally:
            keeper.cancel()
            for task in running:
                task.cancel()
            await asyncio.gather(keeper, *running, return_exceptions=True)

    async def finalize(self, stored: StoredBatch, status: str, results: dict[int, LineResult]
                       ) -> None:
        """Writes the output file (the 2xx answers) and the error file (the rest), in input
        order, then the batch's final record; their ids come from the batch's, so a second
        finalize (its frontend died half-way) replaces rather than adds."""
        batch, now = stored.batch, int(time.time())
        ordered = [results[i] for i in sorted(results)]
        counts = batch.request_counts
        counts.completed = sum(1 for r in ordered if r.ok)
        counts.failed = len(ordered) - counts.completed
        stored.expired = sum(1 for r in ordered
                             if r.line.error is not None and r.line.error.code == "batch_expired")
        if status != "failed":
            batch.finalizing_at = now
        hex_id = batch.id.split("_", 1)[-1]
        for ok, field, suffix in ((True, "output_file_id", "output"),
                                  (False, "error_file_id", "error")):
            chosen = [r.line for r in ordered if r.ok == ok]
            if chosen:
                made = await self.files.create(
                    b"".join(_encode(line) + b"\n" for line in chosen),
                    f"{batch.id}_{suffix}.jsonl", "batch_output", stored.owner,
                    file_id=f"file-{hex_id}{suffix[0]}")
                setattr(batch, field, made.id)
        batch.status = status
        setattr(batch, f"{status}_at", now)
        await self.batches.put(stored)
        await self.batches.finished(batch.id, results.keys())

    async def _keep(self, stored: StoredBatch, results: dict, stop: asyncio.Event,
                    ending: list[str]) -> None:
        """Every LEASE_S / 3: renew the lease, look for a cancel or the expiry, and write
        the counts so far."""
        batch_id = stored.batch.id
        while True:
            await asyncio.sleep(LEASE_S / 3)
            try:
                if not await self.batches.lease(batch_id, self.holder):
                    ending.append("lost")
                elif (at := await self.batches.cancel_asked(batch_id)) is not None:
                    stored.batch.cancelling_at = stored.batch.cancelling_at or at
                    ending.append("cancelled")
                elif time.time() > stored.batch.expires_at:
                    ending.append("expired")
                else:
                    await self._count(stored, results)
                    continue
            except StoreUnavailable:
                continue  # keep running; a line whose result is not stored runs again
            stop.set()
            return

    async def _count(self, stored: StoredBatch, results: dict) -> None:
        counts = stored.batch.request_counts
        counts.completed = sum(1 for r in results.values() if r.ok)
        counts.failed = len(results) - counts.completed
        if await self.batches.cancel_asked(stored.batch.id) is None:
            await self.batches.put(stored)

    async def _record(self, batch_id: str, index: int, result: LineResult,
                      results: dict) -> None:
        try:
            await self.batches.put_result(batch_id, index, result)
        except ValueTooLarge:
            result = _error_line(result.line.custom_id, "response_too_large",
                                 "the answer is larger than the state store keeps "
                                 "(--max-stored-bytes)")
            await self.batches.put_result(batch_id, index, result)
        results[index] = result

    async def _line(self, batch_id: str, index: int, line: InputLine, results: dict) -> None:
        body = dict(line.body)
        if line.url in PRIORITIZED and not body.get("priority"):
            body["priority"] = BATCH_PRIORITY
        status, answer = await self.dispatch(line.url, _encode(body))
        try:
            decoded = msgspec.json.decode(answer)
        except msgspec.DecodeError:
            decoded = answer.decode(errors="replace")
        request_id = (decoded.get("id") if isinstance(decoded, dict) else None) or \
            f"req_{uuid.uuid4().hex}"
        result = LineResult(200 <= status < 300, OutputLine(
            f"batch_req_{uuid.uuid4().hex}", line.custom_id,
            LineResponse(status, str(request_id), decoded), None))
        await self._record(batch_id, index, result, results)


async def _acquire_or_stop(semaphore: asyncio.Semaphore, stop: asyncio.Event) -> None:
    """Takes a line slot, or returns when `stop` is set first (then holding none)."""
    acquiring = asyncio.ensure_future(semaphore.acquire())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if stop.is_set():
        if acquiring.done() and not acquiring.cancelled():
            semaphore.release()
        else:
            acquiring.cancel()


def _expire_the_rest(planned: list, results: dict[int, LineResult]) -> None:
    """Every line of an expired batch that never ran gets its batch_expired error."""
    for index, item in enumerate(planned):
        if index not in results:
            custom_id = item.custom_id if isinstance(item, InputLine) else None
            results[index] = _error_line(custom_id, "batch_expired",
                                         "the batch expired before this request ran")
