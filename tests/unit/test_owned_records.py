"""Every kind of record in the state store (frontend.state.owned_records) reads the same way:
its owner gets it, another API key gets a 404 in that kind's words, as if it did not exist,
and the batch runner (owner None) reads any. Over a real MemoryStore."""

from __future__ import annotations

import asyncio

import pytest

from frontend.base.errors import APIError
from frontend.batches.records import FileRecords
from frontend.responses.conversations import ConversationRecords
from frontend.responses.models import ResponseObject, TextOut
from frontend.responses.stored import ResponseRecords, StoredResponse
from frontend.state.store import MemoryStore


async def _response(store: MemoryStore, owner: str) -> tuple[ResponseRecords, str]:
    records = ResponseRecords(store)
    response = ResponseObject("resp_1", 0, "m", "completed", [], True, "auto", [],
                              TextOut(format={"type": "text"}), True)
    assert await records.put(StoredResponse(response, [], owner=owner))
    return records, "resp_1"


async def _conversation(store: MemoryStore, owner: str) -> tuple[ConversationRecords, str]:
    records = ConversationRecords(store)
    return records, (await records.create(owner, [], {})).conversation.id


async def _file(store: MemoryStore, owner: str) -> tuple[FileRecords, str]:
    records = FileRecords(store)
    return records, (await records.create(b"{}\n", "in.jsonl", "batch", owner)).id


@pytest.mark.parametrize("make, missing", [
    (_response, "Response with id '{}' not found."),
    (_conversation, "Conversation with id '{}' not found."),
    (_file, "No such File object: {}"),
])
def test_a_record_is_its_owners_and_a_404_to_anyone_else(make, missing):
    async def main():
        records, record_id = await make(MemoryStore(), "alice")
        assert (await records.find(record_id, "alice")).owner == "alice"
        assert await records.get(record_id, None) is not None  # the runner reads any
        assert await records.get(record_id, "bob") is None
        for absent, owner in ((record_id, "bob"), ("nope", "alice")):
            with pytest.raises(APIError) as caught:
                await records.find(absent, owner, "the_param")
            assert (caught.value.status, caught.value.param) == (404, "the_param")
            assert caught.value.message == missing.format(absent)

    asyncio.run(main())
