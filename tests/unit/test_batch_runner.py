"""The batch runner (frontend.batches.runner) in-process over a memory store: how lines are
read, the bound on lines in flight, a resumed batch running only the lines without a result,
and a batch past its completion window. The route a line reaches is stood in for by a
dispatch that echoes (tests/integration/test_batches.py runs the real routes)."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from frontend.batches.models import BatchObject, LineResult, OutputLine, RequestCounts, StoredBatch
from frontend.batches.records import BatchRecords, FileRecords
from frontend.batches.runner import BATCH_PRIORITY, BatchRunner, plan_lines, split_lines
from frontend.state.store import MemoryStore, SqliteStore

URL = "/v1/chat/completions"


def line(custom_id: str, **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL,
                       "body": {"messages": [], **body}}).encode()


def test_lines_are_read_into_requests_or_error_entries():
    raw = [line("a"), b"{not json", json.dumps({"custom_id": "b"}).encode(),
           line("a"), json.dumps({"custom_id": "c", "method": "GET", "url": URL,
                                  "body": {}}).encode(),
           json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions",
                       "body": {}}).encode(), line("e", stream=True), line("f")]
    planned = plan_lines(raw, URL)
    codes = [p.line.error.code if isinstance(p, LineResult) else p.custom_id for p in planned]
    assert codes == ["a", "invalid_json_line", "invalid_request", "duplicate_custom_id",
                     "invalid_method", "invalid_url", "invalid_request", "f"]
    assert planned[2].line.custom_id == "b"  # read from a line of the wrong shape
    assert split_lines(b"\n" + raw[0] + b"\n  \n" + raw[1] + b"\n") == raw[:2]


class Echo:
    """Answers each line after a short wait, counting how many are in flight at once."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self.seen: list[dict] = []

    async def __call__(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(0.02)
        self.now -= 1
        request = msgspec.json.decode(body)
        self.seen.append(request)
        status = 400 if request.get("bad") else 200
        return status, json.dumps({"id": f"chatcmpl-{len(self.seen)}", **request}).encode()


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path):
    """The embedded stores; Redis runs under the same runner in test_batches.py."""
    return MemoryStore() if request.param == "memory" else SqliteStore(str(tmp_path / "s.db"))


async def _setup(store, lines: list[bytes], expires_in: float = 3600.0):
    files, batches = FileRecords(store), BatchRecords(store)
    source = await files.create(b"\n".join(lines), "in.jsonl", "batch", "owner")
    now = int(time.time())
    stored = StoredBatch(BatchObject("batch_x", URL, source.id, "24h", "validating", now,
                                     int(now + expires_in), RequestCounts()), "owner")
    await batches.put(stored)
    await batches.mark_active("batch_x")
    echo = Echo()
    return files, batches, echo, BatchRunner(batches, files, echo, 2, 3)


async def _run_to_end(runner: BatchRunner, batches: BatchRecords) -> StoredBatch:
    runner.kick()
    for _ in range(500):
        await asyncio.sleep(0.01)
        stored = await batches.get("batch_x", None)
        if stored.batch.status in ("completed", "expired", "cancelled", "failed"):
            return stored
    raise AssertionError("the batch did not finish")


async def _active_after_cleanup(batches: BatchRecords) -> list[str]:
    """The unfinished batches once the runner's clean-up ran: it follows the final record,
    which is what `_run_to_end` sees first."""
    for _ in range(200):
        active = await batches.active()
        if not active:
            return active
        await asyncio.sleep(0.01)
    return active


def test_a_batch_runs_with_a_bounded_number_of_lines_in_flight(store):
    async def main():
        lines = [line(f"r{i}", bad=i == 4) for i in range(12)] + [b"[1"]
        files, batches, echo, runner = await _setup(store, lines)
        stored = await _run_to_end(runner, batches)
        assert echo.most == 3  # --max-batch-lines-in-flight
        assert all(r["priority"] == BATCH_PRIORITY for r in echo.seen)
        counts = stored.batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (13, 11, 2)
        output = await files.content(await files.get(stored.batch.output_file_id, "owner"))
        ids = [json.loads(x)["custom_id"] for x in output.splitlines()]
        assert ids == [f"r{i}" for i in range(12) if i != 4]
        assert await _active_after_cleanup(batches) == []  # nothing left for the sweeps
        await runner.stop()

    asyncio.run(main())


def test_a_resumed_batch_runs_only_the_lines_without_a_result(store):
    async def main():
        files, batches, echo, runner = await _setup(store, [line(f"r{i}", n=i)
                                                           for i in range(6)])
        done = LineResult(True, OutputLine("batch_req_1", "r1", None, None))
        await batches.put_result("batch_x", 1, done)  # finished by a frontend that died
        stored = await _run_to_end(runner, batches)
        assert sorted(r["n"] for r in echo.seen) == [0, 2, 3, 4, 5]
        assert stored.batch.request_counts.completed == 6
        await runner.stop()

    asyncio.run(main())


def test_a_batch_past_its_window_expires_with_its_lines_in_the_error_file(store):
    async def main():
        files, batches, echo, runner = await _setup(store, [line("a"), line("b")],
                                                    expires_in=-1)
        stored = await _run_to_end(runner, batches)
        assert stored.batch.status == "expired" and stored.batch.expired_at
        assert echo.seen == [] and stored.expired == 2
        errors = await files.content(await files.get(stored.batch.error_file_id, "owner"))
        assert {json.loads(x)["error"]["code"] for x in errors.splitlines()} == {
            "batch_expired"}
        await runner.stop()

    asyncio.run(main())
