"""Anthropic's Message Batches (`/v1/messages/batches`) over the same batch runner as
OpenAI's Batch API: the requests become a JSONL input file of `/v1/messages` lines, and the
output and error files are read back in Anthropic's result shape."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.base.errors import APIError, bad_request
from frontend.batches.api import Batches, _query_int, cancel_stored, new_batch, page
from frontend.batches.models import (
    UNFINISHED,
    AnthropicBatchCreate,
    AnthropicCounts,
    MessageBatch,
    MessageBatchList,
    StoredBatch,
)
from frontend.batches.runner import split_lines

ENDPOINT = "/v1/messages"
WINDOW_S = 24 * 3600  # Anthropic's batches expire after 24 hours
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_encode = msgspec.json.Encoder().encode


def _time(t: int | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _ended(stored: StoredBatch) -> bool:
    return stored.batch.status not in UNFINISHED


def shape(http: Request, stored: StoredBatch) -> MessageBatch:
    batch, ended = stored.batch, _ended(stored)
    counts = batch.request_counts
    expired = stored.expired
    done = counts.completed + counts.failed
    status = {"cancelling": "canceling"}.get(batch.status, "ended" if ended else "in_progress")
    ended_at = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
    url = f"{str(http.base_url).rstrip('/')}{ENDPOINT}/batches/{batch.id}/results"
    return MessageBatch(
        batch.id, status,
        AnthropicCounts(processing=0 if ended else counts.total - done,
                        succeeded=counts.completed, errored=counts.failed - expired,
                        canceled=counts.total - done if batch.status == "cancelled" else 0,
                        expired=expired),
        _time(batch.created_at), _time(batch.expires_at), _time(ended_at) if ended else None,
        _time(batch.cancelling_at), results_url=url if ended else None)


async def create(http: Request, body: AnthropicBatchCreate, owner: str, b: Batches
                 ) -> MessageBatch:
    if not body.requests:
        raise bad_request("requests must not be empty", "requests")
    if len(body.requests) > b.settings.max_lines:
        raise bad_request(f"at most {b.settings.max_lines} requests in one batch "
                          "(--max-batch-lines)", "requests")
    seen = set()
    for i, request in enumerate(body.requests):
        if not _CUSTOM_ID.fullmatch(request.custom_id):
            raise bad_request("custom_id must be 1 to 64 letters, digits, '-' or '_'",
                              f"requests[{i}].custom_id")
        if request.custom_id in seen:
            raise bad_request(f"custom_id {request.custom_id!r} is used twice",
                              f"requests[{i}].custom_id")
        if request.params.get("stream"):
            raise bad_request("streaming is not supported in a batch",
                              f"requests[{i}].params.stream")
        seen.add(request.custom_id)
    content = b"".join(_encode({"custom_id": r.custom_id, "method": "POST", "url": ENDPOINT,
                                "body": r.params}) + b"\n" for r in body.requests)
    if len(content) > b.settings.max_file_bytes:
        raise APIError(413, f"the requests are larger than {b.settings.max_file_bytes} bytes "
                            "(--max-batch-file-bytes)")
    source = await b.files.create(content, "message_batch_requests.jsonl", "message_batch",
                                  owner)
    return shape(http, await new_batch(b, owner, ENDPOINT, source.id, "24h", WINDOW_S, None,
                                       kind="anthropic", prefix="msgbatch_"))


async def _find(http: Request, owner: str, b: Batches) -> StoredBatch:
    return await b.batches.find(http.path_params["batch_id"], owner, "anthropic")


async def retrieve(http: Request, owner: str, b: Batches) -> MessageBatch:
    return shape(http, await _find(http, owner, b))


async def list_batches(http: Request, owner: str, b: Batches) -> MessageBatchList:
    limit = _query_int(http, "limit", 20, 1, 1000)
    stored = await b.batches.list(owner, "anthropic")
    stored.sort(key=lambda s: (s.batch.created_at, s.batch.id), reverse=True)
    data, more = page(stored, lambda s: s.batch.id, http.query_params.get("after_id"), limit)
    shaped = [shape(http, s) for s in data]
    return MessageBatchList(shaped, more, shaped[0].id if shaped else None,
                            shaped[-1].id if shaped else None)


async def cancel(http: Request, owner: str, b: Batches) -> MessageBatch:
    stored = await _find(http, owner, b)
    if not _ended(stored):
        stored = await cancel_stored(b, stored)
    return shape(http, stored)


async def delete(http: Request, owner: str, b: Batches) -> dict:
    stored = await _find(http, owner, b)
    if not _ended(stored):
        raise bad_request("a batch that is still processing cannot be deleted; cancel it "
                          "first")
    for file_id in (stored.batch.input_file_id, stored.batch.output_file_id,
                    stored.batch.error_file_id):
        found = file_id and await b.files.get(file_id, None)
        if found:
            await b.files.delete(found)
    await b.batches.store.delete(f"batch:{stored.batch.id}")
    return {"id": stored.batch.id, "type": "message_batch_deleted"}


def _result(line: dict) -> dict:
    """An OpenAI output or error line as Anthropic's result."""
    response, error = line.get("response"), line.get("error")
    if response is not None and 200 <= response["status_code"] < 300:
        return {"type": "succeeded", "message": response["body"]}
    if error is not None and error["code"] == "batch_expired":
        return {"type": "expired"}
    if response is not None:
        body = response["body"]
    else:
        body = {"type": "error", "error": {"type": "invalid_request_error",
                                           "message": error["message"]}}
    return {"type": "errored", "error": body}


async def results(http: Request, owner: str, b: Batches) -> Response:
    stored = await _find(http, owner, b)
    if not _ended(stored):
        raise bad_request(f"batch {stored.batch.id} is still processing: its results are "
                          "ready when processing_status is 'ended'")
    by_id: dict[str, dict] = {}
    for file_id in (stored.batch.output_file_id, stored.batch.error_file_id):
        found = file_id and await b.files.get(file_id, None)
        content = found and await b.files.content(found)
        for raw in split_lines(content or b""):
            line = msgspec.json.decode(raw)
            if line.get("custom_id") is not None:
                by_id[line["custom_id"]] = _result(line)
    source = await b.files.get(stored.batch.input_file_id, None)
    content = source and await b.files.content(source)
    out = []
    for raw in split_lines(content or b""):
        custom_id = msgspec.json.decode(raw)["custom_id"]
        result = by_id.get(custom_id, {"type": "canceled"})
        out.append(_encode({"custom_id": custom_id, "result": result}) + b"\n")
    return Response(b"".join(out), media_type="application/binary")
