"""The bodies of OpenAI's Files and Batch APIs and Anthropic's Message Batches, and the
records the batch wing keeps in the state store."""

from __future__ import annotations

from typing import Any

import msgspec

# ---------------------------------------------------------------- OpenAI Files


class FileObject(msgspec.Struct):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str  # "batch" (uploads), "batch_output" (what a batch writes)
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(msgspec.Struct):
    data: list[FileObject]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: str = "list"


class Deleted(msgspec.Struct):
    id: str
    object: str
    deleted: bool = True


# ---------------------------------------------------------------- OpenAI Batches


class BatchCreate(msgspec.Struct, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    # OpenAI's expiry of the output files: accepted, and the batch TTL applies instead.
    output_expires_after: dict[str, Any] | None = None


class RequestCounts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorData(msgspec.Struct):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(msgspec.Struct):
    data: list[BatchErrorData]
    object: str = "list"


class BatchObject(msgspec.Struct):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str  # validating, in_progress, finalizing, completed, failed, expired,
    created_at: int  # cancelling, cancelled
    expires_at: int
    request_counts: RequestCounts
    object: str = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    metadata: dict[str, str] | None = None


class BatchList(msgspec.Struct):
    data: list[BatchObject]
    has_more: bool
    first_id: str | None
    last_id: str | None
    object: str = "list"


UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")

# ---------------------------------------------------------------- lines


class InputLine(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a batch input file."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class LineResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: Any


class LineError(msgspec.Struct):
    code: str
    message: str


class OutputLine(msgspec.Struct, omit_defaults=False):
    """One line of an output or error file, in OpenAI's shape."""

    id: str
    custom_id: str | None
    response: LineResponse | None
    error: LineError | None


class LineResult(msgspec.Struct):
    """What the store keeps per finished line until the batch is finalized."""

    ok: bool  # a 2xx answer: the output file; otherwise the error file
    line: OutputLine


# ---------------------------------------------------------------- records


class StoredFile(msgspec.Struct):
    file: FileObject
    owner: str
    parts: int  # the content, in `parts` values of at most the store's value size


class StoredBatch(msgspec.Struct):
    batch: BatchObject
    owner: str
    kind: str = "openai"  # "anthropic": made by /v1/messages/batches, read in its shape
    expired: int = 0  # of the failed lines, those the batch's expiry ended


# ---------------------------------------------------------------- Anthropic Message Batches


class AnthropicBatchRequest(msgspec.Struct, forbid_unknown_fields=True):
    custom_id: str
    params: dict[str, Any]


class AnthropicBatchCreate(msgspec.Struct, forbid_unknown_fields=True):
    requests: list[AnthropicBatchRequest]


class AnthropicCounts(msgspec.Struct):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(msgspec.Struct):
    id: str
    processing_status: str  # in_progress, canceling, ended
    request_counts: AnthropicCounts
    created_at: str  # RFC 3339
    expires_at: str
    ended_at: str | None = None
    cancel_initiated_at: str | None = None
    archived_at: str | None = None
    results_url: str | None = None
    type: str = "message_batch"


class MessageBatchList(msgspec.Struct):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None
