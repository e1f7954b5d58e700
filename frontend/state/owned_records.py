"""What every kind of record kept in the state store shares: one record per id at
`{prefix}:{id}`, owned by the API key that made it (a hash, `owner`), so another key's record
reads as missing, a 404, as OpenAI's API answers (stored responses, conversations, files).

A kind of record is a subclass that names its key prefix, its decoder and its 404; it keeps
its own `__init__`, writes and lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

import msgspec

from frontend.base.errors import APIError
from frontend.state.store import StateStore

Record = TypeVar("Record")


class OwnedRecords(Generic[Record]):
    store: StateStore
    prefix: ClassVar[str]  # the records' keys are f"{prefix}:{id}"
    decoder: ClassVar[msgspec.json.Decoder]
    # The 404 for an id that is missing or another owner's; `param` names the request field.
    not_found: ClassVar[Callable[[str, str | None], APIError]]

    def key(self, record_id: str) -> str:
        return f"{self.prefix}:{record_id}"

    async def get(self, record_id: str, owner: str | None) -> Record | None:
        """The record, if `owner` owns it (None: whoever does); else None."""
        return await self.store.get_owned(self.key(record_id), self.decoder, owner)

    async def find(self, record_id: str, owner: str, param: str | None = None) -> Record:
        """The record, or its kind's 404 when it is missing or another owner's."""
        record = await self.get(record_id, owner)
        if record is None:
            raise self.not_found(record_id, param)
        return record
