"""A background response's stored event stream (frontend.responses.events) and the
conversation records' lock (frontend.responses.conversations), in-process over the real
stores: two SqliteStore objects on one file stand for two frontends."""

from __future__ import annotations

import asyncio

import pytest

from frontend.base.errors import APIError
from frontend.responses import events
from frontend.responses.conversations import ConversationRecords
from frontend.state.store import MemoryStore, SqliteStore


def event(n: int, kind: str = "response.output_text.delta", text: str = "x") -> bytes:
    return f"event: {kind}\ndata: {{\"sequence_number\": {n}, \"t\": \"{text}\"}}\n\n".encode()


async def collect(store, after: int, finished=None) -> list[bytes]:
    async def never() -> bool:
        return False
    return [e async for e in events.follow(store, "r", after, finished or never)]


def test_events_replay_across_chunks_and_follow_the_live_end(tmp_path):
    async def main():
        writer_store = SqliteStore(str(tmp_path / "s.db"))
        reader_store = SqliteStore(str(tmp_path / "s.db"))  # another frontend
        log = events.EventLog(writer_store, "r", None, 1 << 20)
        made = [event(n) for n in range(events.CHUNK * 2 + 5)]
        for e in made:
            log.add(e)
        await log.flush(force=True)
        assert await events.count(reader_store, "r") == len(made)
        follower = asyncio.ensure_future(collect(reader_store, events.CHUNK - 2))
        await asyncio.sleep(0.2)  # it has replayed the stored ones and waits
        assert not follower.done()
        final = event(len(made), "response.completed")
        log.add(final)
        await log.flush(force=True)
        got = await asyncio.wait_for(follower, 5)
        assert got == made[events.CHUNK - 1:] + [final]
        # After the final event nothing follows, at once.
        assert await asyncio.wait_for(collect(reader_store, len(made)), 1) == []
        await events.forget(writer_store, "r")
        assert await events.count(reader_store, "r") == 0

    asyncio.run(main())


def test_events_past_the_byte_bound_keep_their_numbers_but_not_deltas():
    async def main():
        store = MemoryStore()
        log = events.EventLog(store, "r", None, max_bytes=len(event(0)) * 3)
        made = [event(0, "response.created"), event(1), event(2), event(3),
                event(4, "response.output_text.done", "xxx"), event(5, "response.completed")]
        for e in made:
            log.add(e)
        await log.flush(force=True)
        assert await events.count(store, "r") == 6  # the numbers stay
        got = await collect(store, -1)
        assert got == made[:3] + made[4:]  # the delta past the bound is skipped

    asyncio.run(main())


def test_a_follower_ends_when_the_response_ended_without_a_final_event(monkeypatch):
    monkeypatch.setattr(events, "CHECK_S", 0.05)
    monkeypatch.setattr(events, "GRACE_S", 0.1)

    async def main():
        store = MemoryStore()
        log = events.EventLog(store, "r", None, 1 << 20)
        log.add(event(0, "response.created"))
        await log.flush(force=True)

        async def cancelled() -> bool:
            return True
        got = await asyncio.wait_for(collect(store, -1, cancelled), 2)
        assert got == [event(0, "response.created")]

    asyncio.run(main())


def test_conversation_changes_from_two_frontends_at_once_lose_nothing(tmp_path):
    async def main():
        one = ConversationRecords(SqliteStore(str(tmp_path / "s.db")), max_items=100)
        two = ConversationRecords(SqliteStore(str(tmp_path / "s.db")), max_items=100)
        record = await one.create("", [], {})
        conv = record.conversation.id

        async def add(records: ConversationRecords, n: int) -> None:
            async with records.changing(conv, "") as current:
                await asyncio.sleep(0.01)  # another change would interleave here
                current.items.append({"id": f"i{n}"})

        await asyncio.gather(*(add(one if n % 2 else two, n) for n in range(20)))
        items = (await two.find(conv, "")).items
        assert sorted(i["id"] for i in items) == sorted(f"i{n}" for n in range(20))
        with pytest.raises(APIError) as caught:  # another owner: a 404
            await one.find(conv, "someone else")
        assert caught.value.status == 404
        with pytest.raises(APIError) as caught:
            one.check_room(await one.find(conv, ""), 81, "items")
        assert caught.value.status == 400 and caught.value.param == "items"

    asyncio.run(main())


def test_a_conversation_larger_than_the_store_keeps_is_a_413():
    async def main():
        records = ConversationRecords(MemoryStore(max_value_bytes=2048), max_items=100)
        with pytest.raises(APIError) as caught:
            await records.create("", [{"id": "i", "text": "x" * 4096}], {})
        assert caught.value.status == 413
        record = await records.create("", [], {})
        with pytest.raises(APIError) as caught:
            async with records.changing(record.conversation.id, "") as current:
                current.items.append({"id": "i", "text": "x" * 4096})
        assert caught.value.status == 413
        assert (await records.find(record.conversation.id, "")).items == []  # unchanged

    asyncio.run(main())
