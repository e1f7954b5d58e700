"""Conversations (`/v1/conversations`, OpenAI's) as records in the shared state store.

A conversation is one record (`conversation:{id}`, a `ConversationRecord`): the
conversation object (id, created_at, metadata), its owner (as stored responses: another API
key gets a 404) and its items, each with an id, in the shape the Responses API lists them
(messages, function calls and their outputs, reasoning). A response created with
`conversation` reads the items as the turns before its input, and when it finishes its
input and output items are appended (frontend.responses.shared.add_to_conversation).

Every change reads, changes and writes the record while holding a short lock in the store
(`conversation-lock:{id}`, a lease), so two frontends appending to one conversation at once
lose nothing. Records do not expire unless `--conversation-ttl` says they do (OpenAI's
conversations have no 30-day limit): then a conversation lives that long after its last
change, each change starting the clock again. They count against the embedded stores'
`--max-stored-responses` like stored responses.

Bounds, as OpenAI's: at most 20 items per create call; metadata at most 16 keys, keys at
most 64 characters, values strings of at most 512; and ours: `--max-conversation-items`
items per conversation, one record at most `--max-stored-bytes` (413).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from frontend.base.errors import APIError, bad_request
from frontend.responses.conversation_models import Conversation, ConversationRecord
from frontend.state.owned_records import OwnedRecords
from frontend.state.store import StateStore, StoreUnavailable, ValueTooLarge

MAX_ITEMS_PER_CALL = 20
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
DEFAULT_MAX_ITEMS = 10_000
LOCK_S = 10.0  # a lock whose holder died frees itself after this
LOCK_WAIT_S = 10.0  # how long a change waits for the lock before a 503

_decoder = msgspec.json.Decoder(ConversationRecord)
_encoder = msgspec.json.Encoder()


def not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found.", param)


def check_metadata(metadata: dict[str, str] | None, param: str = "metadata") -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata has {len(metadata)} keys; at most "
                          f"{MAX_METADATA_KEYS} are allowed", param)
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(f"metadata key {key[:20]!r}... is {len(key)} characters; at "
                              f"most {MAX_METADATA_KEY_CHARS} are allowed", param)
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"metadata value of {key!r} is {len(value)} characters; at "
                              f"most {MAX_METADATA_VALUE_CHARS} are allowed", param)
    return metadata


class ConversationRecords(OwnedRecords[ConversationRecord]):
    """Conversations in a `StateStore`."""

    prefix = "conversation"
    decoder = _decoder
    not_found = staticmethod(not_found)

    def __init__(self, store: StateStore, max_items: int = DEFAULT_MAX_ITEMS,
                 ttl_s: float | None = None) -> None:
        self.store = store
        self.max_items = max_items
        self.ttl_s = ttl_s  # None: kept until evicted or deleted

    async def _put(self, record: ConversationRecord) -> None:
        try:
            await self.store.put(f"conversation:{record.conversation.id}",
                                 _encoder.encode(record), self.ttl_s, counted=True)
        except ValueTooLarge:
            raise APIError(413, "the conversation would be larger than the state store "
                                "keeps (--max-stored-bytes)") from None

    def check_room(self, record: ConversationRecord, adding: int, param: str) -> None:
        if len(record.items) + adding > self.max_items:
            raise bad_request(
                f"the conversation has {len(record.items)} items; adding {adding} would pass "
                f"the {self.max_items} a conversation may hold", param)

    async def create(self, owner: str, items: list[dict[str, Any]], metadata: dict[str, str]
                     ) -> ConversationRecord:
        record = ConversationRecord(
            Conversation(f"conv_{uuid.uuid4().hex}", int(time.time()), metadata), owner)
        self.check_room(record, len(items), "items")
        record.items = items
        await self._put(record)
        return record

    @contextlib.asynccontextmanager
    async def changing(self, conversation_id: str, owner: str, param: str | None = None
                       ) -> AsyncIterator[ConversationRecord]:
        """The record, to change in place; written back when the block ends without an
        error. The lock keeps other frontends' changes out meanwhile."""
        key = f"conversation-lock:{conversation_id}"
        holder = uuid.uuid4().hex  # this change (two on one frontend must not share it)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOCK_WAIT_S
        while not await self.store.claim(key, holder, LOCK_S):
            if loop.time() > deadline:
                raise StoreUnavailable(f"conversation {conversation_id} stayed locked")
            await asyncio.sleep(0.02)
        try:
            record = await self.find(conversation_id, owner, param)
            yield record
            await self._put(record)
        finally:
            await self.store.delete(key)

    async def delete(self, conversation_id: str, owner: str) -> None:
        await self.find(conversation_id, owner)
        await self.store.delete(f"conversation:{conversation_id}")
