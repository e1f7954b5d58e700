"""OpenAI's Files (`/v1/files`, purpose `batch`) and Batch API (`/v1/batches`) over the
shared state store; the batches run in `frontend.batches.runner`.

Every object belongs to its owner (a hash of the API key that made it, where keys are
configured; `owner` comes from the route): another key gets a 404, as for an unknown id.
"""

from __future__ import annotations

import time
import uuid

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from frontend.base.errors import APIError, bad_request
from frontend.batches.models import (
    UNFINISHED,
    BatchCreate,
    BatchList,
    BatchObject,
    Deleted,
    FileList,
    FileObject,
    RequestCounts,
    StoredBatch,
)
from frontend.batches.records import BatchRecords, FileRecords
from frontend.batches.runner import BatchRunner, split_lines

COMPLETION_WINDOW_S = {"24h": 24 * 3600}
UPLOAD_PURPOSES = ("batch",)


class BatchSettings(msgspec.Struct):
    max_file_bytes: int = 100 * 2**20
    max_lines: int = 50_000
    max_active: int = 100  # unfinished batches in the store, all frontends together
    endpoints: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions")


class Batches(msgspec.Struct):
    """What the routes share."""

    files: FileRecords
    batches: BatchRecords
    runner: BatchRunner
    settings: BatchSettings


def _json(body) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def _query_int(http: Request, name: str, default: int, low: int, high: int) -> int:
    text = http.query_params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise bad_request(f"{name} must be an integer", name) from None
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}", name)
    return value


def _order(http: Request) -> str:
    order = http.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    return order


def page(items: list, id_of, after: str | None, limit: int):
    """The `limit` items after the one with id `after` (a 400 when there is no such item),
    and whether more follow."""
    if after is not None:
        ids = [id_of(item) for item in items]
        if after not in ids:
            raise bad_request(f"no object with id {after!r} in this list", "after")
        items = items[ids.index(after) + 1:]
    return items[:limit], len(items) > limit


# ---------------------------------------------------------------- files


async def upload_file(http: Request, owner: str, b: Batches) -> Response:
    try:
        form = await http.form(max_files=1, max_fields=8)
    except Exception as exc:  # a malformed multipart body (Starlette's MultiPartException)
        raise bad_request(f"the upload is not a valid multipart form: {exc}", "file") from None
    try:
        purpose = form.get("purpose")
        if not isinstance(purpose, str) or purpose not in UPLOAD_PURPOSES:
            raise bad_request(f"purpose {purpose!r} is not supported: this server takes "
                              "files with purpose 'batch'", "purpose")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise bad_request("send the file as the multipart field 'file'", "file")
        limit = b.settings.max_file_bytes
        content = await upload.read(limit + 1)
        if len(content) > limit:
            raise APIError(413, f"the file is larger than {limit} bytes "
                                "(--max-batch-file-bytes)", "file")
        lines = len(split_lines(content))
        if lines > b.settings.max_lines:
            raise bad_request(f"the file has {lines} requests; at most {b.settings.max_lines} "
                              "(--max-batch-lines)", "file")
        if lines == 0:
            raise bad_request("the file holds no requests (one JSON object per line)", "file")
        made = await b.files.create(content, upload.filename or "upload.jsonl", purpose, owner)
    finally:
        await form.close()
    return _json(made)


async def list_files(http: Request, owner: str, b: Batches) -> Response:
    purpose = http.query_params.get("purpose")
    limit = _query_int(http, "limit", 10_000, 1, 10_000)
    files = [f for f in await b.files.list(owner) if purpose is None or f.purpose == purpose]
    files.sort(key=lambda f: (f.created_at, f.id), reverse=_order(http) == "desc")
    data, more = page(files, lambda f: f.id, http.query_params.get("after"), limit)
    return _json(FileList(data, more, data[0].id if data else None,
                          data[-1].id if data else None))


async def get_file(http: Request, owner: str, b: Batches) -> FileObject:
    return (await b.files.find(http.path_params["file_id"], owner)).file


async def file_content(http: Request, owner: str, b: Batches) -> Response:
    stored = await b.files.find(http.path_params["file_id"], owner)
    content = await b.files.content(stored)
    if content is None:
        raise APIError(404, f"The content of {stored.file.id} is gone (expired)")
    return Response(content, media_type="application/octet-stream")


async def delete_file(http: Request, owner: str, b: Batches) -> Response:
    stored = await b.files.find(http.path_params["file_id"], owner)
    await b.files.delete(stored)
    return _json(Deleted(stored.file.id, "file"))


# ---------------------------------------------------------------- batches


async def create_batch(body: BatchCreate, owner: str, b: Batches) -> Response:
    if body.endpoint not in b.settings.endpoints:
        raise bad_request(f"endpoint {body.endpoint!r} is not supported: one of "
                          f"{', '.join(b.settings.endpoints)}", "endpoint")
    window = COMPLETION_WINDOW_S.get(body.completion_window)
    if window is None:
        raise bad_request("completion_window must be '24h'", "completion_window")
    check_metadata(body.metadata)
    source = await b.files.find(body.input_file_id, owner, "input_file_id")
    if source.file.purpose != "batch":
        raise bad_request(f"{source.file.id} has purpose {source.file.purpose!r}, not "
                          "'batch'", "input_file_id")
    stored = await new_batch(b, owner, body.endpoint, body.input_file_id,
                             body.completion_window, window, body.metadata)
    return _json(stored.batch)


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise bad_request("metadata may hold at most 16 pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise bad_request("metadata keys are at most 64 characters and values at most "
                              "512", f"metadata.{key[:64]}")


async def new_batch(b: Batches, owner: str, endpoint: str, input_file_id: str,
                    window_name: str, window_s: int, metadata: dict[str, str] | None,
                    kind: str = "openai", prefix: str = "batch_") -> StoredBatch:
    """Stores a batch `validating` and marks it for the runners; this frontend's starts it
    at once when it has room, another frontend's sweep otherwise."""
    active = await b.batches.active()
    if len(active) >= b.settings.max_active:
        raise APIError(429, f"{len(active)} batches are unfinished; at most "
                            f"{b.settings.max_active} (--max-active-batches): retry later")
    now = int(time.time())
    batch = BatchObject(f"{prefix}{uuid.uuid4().hex}", endpoint, input_file_id, window_name,
                        "validating", now, now + window_s, RequestCounts(), metadata=metadata)
    stored = StoredBatch(batch, owner, kind)
    await b.batches.put(stored)
    await b.batches.mark_active(batch.id)
    b.runner.kick()
    return stored


async def get_batch(http: Request, owner: str, b: Batches) -> Response:
    return _json((await b.batches.find(http.path_params["batch_id"], owner, "openai")).batch)


async def list_batches(http: Request, owner: str, b: Batches) -> Response:
    limit = _query_int(http, "limit", 20, 1, 100)
    batches = [s.batch for s in await b.batches.list(owner, "openai")]
    batches.sort(key=lambda x: (x.created_at, x.id), reverse=True)
    data, more = page(batches, lambda x: x.id, http.query_params.get("after"), limit)
    return _json(BatchList(data, more, data[0].id if data else None,
                           data[-1].id if data else None))


async def cancel_stored(b: Batches, stored: StoredBatch) -> StoredBatch:
    """Asks the batch's runner (on any frontend) to stop; the record says `cancelling` until
    the runner has written what finished and marked it `cancelled`."""
    batch = stored.batch
    if batch.status in ("cancelling", "cancelled"):
        return stored
    if batch.status not in UNFINISHED:
        raise APIError(409, f"Cannot cancel a batch with status '{batch.status}'.")
    now = int(time.time())
    batch.status, batch.cancelling_at = "cancelling", now
    await b.batches.put(stored)
    await b.batches.ask_cancel(batch.id, now)
    b.runner.kick()  # a batch nobody runs yet is finalized by whoever claims it
    return stored


async def cancel_batch(http: Request, owner: str, b: Batches) -> Response:
    stored = await b.batches.find(http.path_params["batch_id"], owner, "openai")
    return _json((await cancel_stored(b, stored)).batch)
