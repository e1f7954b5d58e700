"""Files and batches as records in the shared state store (frontend.state.store).

Keys (none of them counted against `--max-stored-responses`; all expire after `--batch-ttl`):
`file:{id}` a file's metadata and owner; `file-part:{id}:{n}` its content, in parts no larger
than the store's value size; `batch:{id}` a batch; `batch-active:{id}` a marker while the
batch is unfinished, for the runners' sweeps; `batch-lease:{id}` the frontend running it;
`batch-cancel:{id}` a cancel asked for (its time); `batch-result:{id}:{index}` one finished
line until the batch is finalized into its output and error files.
"""

from __future__ import annotations

import time
import uuid

import msgspec

from frontend.base.errors import APIError
from frontend.batches.models import FileObject, LineResult, StoredBatch, StoredFile
from frontend.state.owned_records import OwnedRecords
from frontend.state.store import StateStore

LEASE_S = 6.0  # a runner renews its batch's lease every LEASE_S / 3
DEFAULT_TTL_S = 30 * 24 * 3600.0

_file = msgspec.json.Decoder(StoredFile)
_batch = msgspec.json.Decoder(StoredBatch)
_result = msgspec.json.Decoder(LineResult)
_encode = msgspec.json.Encoder().encode


def file_not_found(file_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param)


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.")


class FileRecords(OwnedRecords[StoredFile]):
    prefix = "file"
    decoder = _file
    not_found = staticmethod(file_not_found)

    def __init__(self, store: StateStore, ttl_s: float | None = DEFAULT_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s or None

    def _part_size(self) -> int:
        return max(1024, min(2**20, self.store.max_value_bytes))

    async def create(self, content: bytes, filename: str, purpose: str, owner: str,
                     file_id: str | None = None) -> FileObject:
        """Stores a file (its parts first, so a record never names parts that are missing).
        A fixed `file_id` makes a rewrite (a batch finalized twice) replace, not add."""
        file_id = file_id or f"file-{uuid.uuid4().hex}"
        now = int(time.time())
        size = self._part_size()
        parts = [content[i:i + size] for i in range(0, len(content), size)]
        for n, part in enumerate(parts):
            await self.store.put(f"file-part:{file_id}:{n}", part, self.ttl_s)
        meta = FileObject(file_id, len(content), now, filename, purpose,
                          expires_at=now + int(self.ttl_s) if self.ttl_s else None)
        await self.store.put(f"file:{file_id}", _encode(StoredFile(meta, owner, len(parts))),
                             self.ttl_s)
        return meta

    async def content(self, stored: StoredFile) -> bytes | None:
        """The file's bytes; None when a part is gone (expired, deleted meanwhile)."""
        out = []
        for n in range(stored.parts):
            part = await self.store.get(f"file-part:{stored.file.id}:{n}")
            if part is None:
                return None
            out.append(part)
        return b"".join(out)

    async def delete(self, stored: StoredFile) -> None:
        await self.store.delete(f"file:{stored.file.id}")
        for n in range(stored.parts):
            await self.store.delete(f"file-part:{stored.file.id}:{n}")

    async def list(self, owner: str) -> list[FileObject]:
        out = []
        for key in await self.store.scan("file:"):
            stored = await self.get(key[len("file:"):], owner)
            if stored is not None:
                out.append(stored.file)
        return out


class BatchRecords:
    def __init__(self, store: StateStore, ttl_s: float | None = DEFAULT_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s or None

    async def get(self, batch_id: str, owner: str | None) -> StoredBatch | None:
        return await self.store.get_owned(f"batch:{batch_id}", _batch, owner)

    async def find(self, batch_id: str, owner: str, kind: str) -> StoredBatch:
        stored = await self.get(batch_id, owner)
        if stored is None or stored.kind != kind:
            raise batch_not_found(batch_id)
        return stored

    async def put(self, stored: StoredBatch) -> None:
        await self.store.put(f"batch:{stored.batch.id}", _encode(stored), self.ttl_s)

    async def list(self, owner: str, kind: str) -> list[StoredBatch]:
        out = []
        for key in await self.store.scan("batch:"):
            stored = await self.get(key[len("batch:"):], owner)
            if stored is not None and stored.kind == kind:
                out.append(stored)
        return out

    # ------------------------------------------------------------ running

    async def mark_active(self, batch_id: str) -> None:
        await self.store.put(f"batch-active:{batch_id}", b"1", self.ttl_s)

    async def active(self) -> list[str]:
        return [key[len("batch-active:"):] for key in await self.store.scan("batch-active:")]

    async def lease(self, batch_id: str, holder: str) -> bool:
        return await self.store.claim(f"batch-lease:{batch_id}", holder, LEASE_S)

    async def ask_cancel(self, batch_id: str, at: int) -> None:
        await self.store.put(f"batch-cancel:{batch_id}", str(at).encode(), self.ttl_s)

    async def cancel_asked(self, batch_id: str) -> int | None:
        raw = await self.store.get(f"batch-cancel:{batch_id}")
        return None if raw is None else int(raw)

    async def put_result(self, batch_id: str, index: int, result: LineResult) -> None:
        await self.store.put(f"batch-result:{batch_id}:{index:09d}", _encode(result),
                             self.ttl_s)

    async def results(self, batch_id: str) -> dict[int, LineResult]:
        prefix = f"batch-result:{batch_id}:"
        out = {}
        for key in await self.store.scan(prefix):
            raw = await self.store.get(key)
            if raw is not None:
                out[int(key[len(prefix):])] = _result.decode(raw)
        return out

    async def finished(self, batch_id: str, indices) -> None:
        """Drops what running the batch needed, once its record says it is done."""
        for index in indices:
            await self.store.delete(f"batch-result:{batch_id}:{index:09d}")
        for key in (f"batch-active:{batch_id}", f"batch-cancel:{batch_id}",
                    f"batch-lease:{batch_id}"):
            await self.store.delete(key)
