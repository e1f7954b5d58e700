"""State that outlives a request, shared by the frontends that point at one store.

One small key-value interface (`StateStore`), chosen by URL (`--state-store`):

- `sqlite:///PATH` (the default, `default_url()`): a file, one host; survives restarts and
  is shared by every frontend on the host that names the same file. sqlite3 is blocking, so
  each call runs in a worker thread (`asyncio.to_thread`); WAL mode and a busy timeout let
  several processes use the file at once.
- `memory://`: this process only, gone with it (tests, or when nothing must be kept).
- `redis://HOST:PORT/DB` (or `rediss://`): a Redis server, shared by many frontends on many
  hosts, through redis-py's asyncio client. Redis, not PostgreSQL: what is stored is a value
  per key with an expiry (TTL) and leases (SET NX PX), which Redis does natively, with no
  schema to migrate.

Values are bytes (the callers encode msgspec Structs). Every entry may carry a TTL. Keys are
grouped by their text up to the last `:` (`batch-result:b1:000000007` is in the group
`batch-result:b1:`, not in `batch-result:`), and `scan` lists one group's live keys through
an index, never the whole store: SQLite's primary key as a range, a sorted set per group in
Redis.
`max_value_bytes` bounds one value (`ValueTooLarge`); `capacity` bounds how many "counted"
entries the embedded stores keep (least recently used dropped first; Redis bounds memory
with its own `maxmemory` policy instead). A store that cannot be reached raises
`StoreUnavailable`, which the routes answer with a 503.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections import OrderedDict

from frontend.base.errors import APIError

DEFAULT_MAX_VALUE_BYTES = 16 * 2**20


class StoreUnavailable(APIError):
    """The store did not answer (a server down, a disk full): a 503, retry later."""

    def __init__(self, detail: str) -> None:
        super().__init__(503, f"The state store is unavailable: {detail}")


class ValueTooLarge(Exception):
    pass


def default_url() -> str:
    """The embedded store's file: $SLUICE_STATE_DIR, else $XDG_STATE_HOME/sluice, else
    ~/.local/state/sluice (the XDG place for state that should survive restarts)."""
    folder = os.environ.get("SLUICE_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "sluice")
    return f"sqlite:///{os.path.join(folder, 'state.db')}"


class StateStore:
    """The interface. `ttl_s` None or 0: no expiry. `counted`: the entry counts against the
    store's capacity (stored objects do; leases and flags do not)."""

    def __init__(self, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        self.max_value_bytes = max_value_bytes

    def _check_size(self, value: bytes) -> None:
        if len(value) > self.max_value_bytes:
            raise ValueTooLarge(f"{len(value)} bytes > {self.max_value_bytes}")

    async def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    async def put(self, key: str, value: bytes, ttl_s: float | None = None,
                  counted: bool = False) -> None:
        raise NotImplementedError

    async def get_owned(self, key: str, decoder, owner: str | None):
        """The record at `key` decoded, if `owner` owns it (None: whoever does); else None,
        so another API key's object reads as missing (a 404), as OpenAI's API does."""
        raw = await self.get(key)
        if raw is None:
            return None
        record = decoder.decode(raw)
        return record if owner is None or record.owner == owner else None

    async def delete(self, key: str) -> bool:
        raise NotImplementedError

    async def scan(self, prefix: str) -> list[str]:
        """The live keys of the group `prefix` (which ends with `:`), written by `put`:
        the keys whose text up to their last `:` is `prefix`."""
        raise NotImplementedError

    async def claim(self, key: str, holder: str, ttl_s: float) -> bool:
        """Takes the lease `key` for `holder` when nobody holds it (or it expired), or
        renews it when `holder` already does; False when someone else holds it."""
        raise NotImplementedError

    async def close(self) -> None:
        pass


def _expiry(ttl_s: float | None) -> float | None:
    return time.time() + ttl_s if ttl_s else None


def _check_group(prefix: str) -> None:
    """A scan lists one group, so that each store can keep an index per group."""
    if not prefix.endswith(":"):
        raise ValueError(f"scan({prefix!r}): a prefix is a key group, ending with ':'")


def _in_group(key: str, group: str) -> bool:
    return key.startswith(group) and ":" not in key[len(group):]


class MemoryStore(StateStore):
    """This process's memory: a dict of (value, expiry), counted entries in LRU order."""

    def __init__(self, capacity: int = 1000, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
                 ) -> None:
        super().__init__(max_value_bytes)
        self.capacity = capacity
        self._items: dict[str, tuple[bytes, float | None]] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()

    def _live(self, key: str) -> bytes | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[1] is not None and item[1] <= time.time():
            self._items.pop(key)
            self._lru.pop(key, None)
            return None
        return item[0]

    async def get(self, key: str) -> bytes | None:
        value = self._live(key)
        if value is not None and key in self._lru:
            self._lru.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes, ttl_s: float | None = None,
                  counted: bool = False) -> None:
        self._check_size(value)
        if counted and self.capacity <= 0:
            return
        self._items[key] = (value, _expiry(ttl_s))
        if counted:
            self._lru[key] = None
            self._lru.move_to_end(key)
            while len(self._lru) > self.capacity:
                self._items.pop(self._lru.popitem(last=False)[0], None)

    async def delete(self, key: str) -> bool:
        self._lru.pop(key, None)
        return self._items.pop(key, None) is not None

    async def scan(self, prefix: str) -> list[str]:
        _check_group(prefix)
        return [k for k in list(self._items) if _in_group(k, prefix) and self._live(k)]

    async def claim(self, key: str, holder: str, ttl_s: float) -> bool:
        current = self._live(key)
        if current is not None and current != holder.encode():
            return False
        self._items[key] = (holder.encode(), _expiry(ttl_s))
        return True


# Every statement a write or a scan runs finds its rows through an index (the primary key,
# or one of the two below), never by reading the whole table; a unit test asks SQLite's
# EXPLAIN QUERY PLAN.
_SCHEMA = ("""
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL,
    expires REAL,          -- unix time; NULL: never
    used REAL NOT NULL,    -- last read or write, for the LRU bound
    counted INTEGER NOT NULL
)""",
           "CREATE INDEX IF NOT EXISTS entries_expires ON entries (expires)",
           "CREATE INDEX IF NOT EXISTS entries_lru ON entries (counted, used)")
_SQL_DROP_EXPIRED = "DELETE FROM entries WHERE expires IS NOT NULL AND expires <= ?"
# The keys of a group `G:` are the ones from `G:` up to, not including, `G;` (';' follows
# ':'), a range of the primary key.
_SQL_SCAN = ("SELECT key FROM entries WHERE key >= ? AND key < ? AND (expires IS NULL OR "
         "expires > ?)")
_SQL_DROP_LEAST_USED = ("DELETE FROM entries WHERE counted = 1 AND key NOT IN (SELECT key FROM "
                    "entries WHERE counted = 1 ORDER BY used DESC LIMIT ?)")


class SqliteStore(StateStore):
    """A SQLite file. One connection, used by one worker thread at a time (a lock)."""

    def __init__(self, path: str, capacity: int = 1000,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        super().__init__(max_value_bytes)
        self.path = path
        self.capacity = capacity
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None  # opened on first use, in the worker

    def _open(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        # isolation_level=None: autocommit; the writes that must be atomic use BEGIN.
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                             timeout=5.0)
        db.execute("PRAGMA journal_mode=WAL")
        for statement in _SCHEMA:
            db.execute(statement)
        return db

    async def _run(self, fn, *args):
        def locked():
            with self._lock:
                if self._db is None:
                    self._db = self._open()
                return fn(*args)
        try:
            return await asyncio.to_thread(locked)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"sqlite {self.path}: {exc}") from exc

    def _get(self, key: str) -> bytes | None:
        now = time.time()
        row = self._db.execute(
            "SELECT value, counted FROM entries WHERE key = ? AND (expires IS NULL OR "
            "expires > ?)", (key, now)).fetchone()
        if row is not None and row[1]:
            self._db.execute("UPDATE entries SET used = ? WHERE key = ?", (now, key))
        return None if row is None else bytes(row[0])

    def _put(self, key: str, value: bytes, expires: float | None, counted: bool) -> None:
        now = time.time()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(_SQL_DROP_EXPIRED, (now,))
            self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?)",
                             (key, value, expires, now, int(counted)))
            if counted:
                self._db.execute(_SQL_DROP_LEAST_USED, (self.capacity,))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _delete(self, key: str) -> bool:
        cursor = self._db.execute(
            "DELETE FROM entries WHERE key = ? AND (expires IS NULL OR expires > ?)",
            (key, time.time()))
        return cursor.rowcount > 0

    def _claim(self, key: str, holder: str, expires: float) -> bool:
        now = time.time()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            row = self._db.execute(
                "SELECT value FROM entries WHERE key = ? AND (expires IS NULL OR expires > ?)",
                (key, now)).fetchone()
            mine = row is None or bytes(row[0]) == holder.encode()
            if mine:
                self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, 0)",
                                 (key, holder.encode(), expires, now))
            self._db.execute("COMMIT")
            return mine
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def _scan(self, prefix: str) -> list[str]:
        rows = self._db.execute(_SQL_SCAN, (prefix, prefix[:-1] + ";", time.time())).fetchall()
        return [row[0] for row in rows if _in_group(row[0], prefix)]

    async def get(self, key: str) -> bytes | None:
        return await self._run(self._get, key)

    async def scan(self, prefix: str) -> list[str]:
        _check_group(prefix)
        return await self._run(self._scan, prefix)

    async def put(self, key: str, value: bytes, ttl_s: float | None = None,
                  counted: bool = False) -> None:
        self._check_size(value)
        if counted and self.capacity <= 0:
            return
        await self._run(self._put, key, value, _expiry(ttl_s), counted)

    async def delete(self, key: str) -> bool:
        return await self._run(self._delete, key)

    async def claim(self, key: str, holder: str, ttl_s: float) -> bool:
        return await self._run(self._claim, key, holder, time.time() + ttl_s)

    async def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


# A key's group has an index, a sorted set of its keys scored by their expiry (ms, server
# time; +inf: never), so a scan reads one group rather than the keyspace. Each write drops
# the index's expired members and lets the index expire with its last key, so a group
# nobody scans again (a finished batch's results) leaves nothing behind.
_PUT = """
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
  redis.call('ZADD', KEYS[2], ms + ttl, KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[2], '+inf', KEYS[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ms)
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]
if last == 'inf' then redis.call('PERSIST', KEYS[2])
else redis.call('PEXPIREAT', KEYS[2], last) end
"""
_DELETE = """
redis.call('ZREM', KEYS[2], KEYS[1])
return redis.call('DEL', KEYS[1])
"""
# The group's live keys; members whose key is gone (expired, or evicted by maxmemory) are
# dropped from the index on the way.
_SCAN = """
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now[1] * 1000 + math.floor(now[2] / 1000)))
local live = {}
for _, key in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('EXISTS', key) == 1 then table.insert(live, key)
  else redis.call('ZREM', KEYS[1], key) end
end
return live
"""

# Take the lease when free, renew it when ours: one atomic step on the server.
_CLAIM = """
local held = redis.call('GET', KEYS[1])
if held == false or held == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


class RedisStore(StateStore):
    """A Redis server (redis-py's asyncio client); keys are prefixed `sluice:`, a group's
    index is `sluice-index:GROUP` (one server, not a cluster: a write touches both)."""

    PREFIX = "sluice:"
    INDEX = "sluice-index:"

    def __init__(self, url: str, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 socket_timeout: float = 5.0) -> None:
        super().__init__(max_value_bytes)
        import redis.asyncio  # only a frontend configured for Redis needs the client
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff

        self.url = url
        # The transient errors, each sent again (on a new connection) a few times before
        # it is a 503: a pooled connection that outlived a Redis restart ("Connection
        # closed by server"), a server still loading its data (LOADING, a ConnectionError
        # subclass), a reply that did not come within `socket_timeout`, and TRYAGAIN (a
        # cluster moving a slot). So a restart costs the requests made while Redis is
        # down, not the ones after. Every command the store sends has the same effect when
        # sent twice.
        transient = [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                     redis.exceptions.TryAgainError]
        self._redis = redis.asyncio.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=2,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3, tuple(transient)),
            retry_on_error=transient)
        self._errors = (*transient, OSError)

    async def _call(self, coro):
        try:
            return await coro
        except self._errors as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    async def get(self, key: str) -> bytes | None:
        return await self._call(self._redis.get(self.PREFIX + key))

    def _keys(self, key: str) -> list[str]:
        """The key and its group's index (none for a key outside any group)."""
        group = key[:key.rfind(":") + 1]
        return [self.PREFIX + key] + ([self.INDEX + group] if group else [])

    async def put(self, key: str, value: bytes, ttl_s: float | None = None,
                  counted: bool = False) -> None:
        self._check_size(value)
        px = max(1, int(ttl_s * 1000)) if ttl_s else 0
        keys = self._keys(key)
        if len(keys) == 1:
            await self._call(self._redis.set(keys[0], value, px=px or None))
            return
        await self._call(self._redis.eval(_PUT, 2, *keys, value, px))

    async def delete(self, key: str) -> bool:
        keys = self._keys(key)
        if len(keys) == 1:
            return bool(await self._call(self._redis.delete(keys[0])))
        return bool(await self._call(self._redis.eval(_DELETE, 2, *keys)))

    async def scan(self, prefix: str) -> list[str]:
        _check_group(prefix)
        keys = await self._call(self._redis.eval(_SCAN, 1, self.INDEX + prefix))
        return [key.decode()[len(self.PREFIX):] for key in keys]

    async def claim(self, key: str, holder: str, ttl_s: float) -> bool:
        return bool(await self._call(self._redis.eval(
            _CLAIM, 1, self.PREFIX + key, holder, int(ttl_s * 1000))))

    async def close(self) -> None:
        await self._redis.aclose()


def open_store(url: str | None, capacity: int = 1000,
               max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> StateStore:
    """The store a `--state-store` URL names; a URL of no known kind is a ValueError."""
    url = url or default_url()
    if url == "memory://":
        return MemoryStore(capacity, max_value_bytes)
    if url.startswith("sqlite:///"):
        return SqliteStore(url[len("sqlite:///"):] if url != "sqlite:///:memory:"
                           else ":memory:", capacity, max_value_bytes)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url, max_value_bytes)
    raise ValueError(f"--state-store {url!r}: expected sqlite:///PATH, memory:// or "
                     "redis://HOST:PORT/DB")
