"""Rate windows (`frontend.state.windows`) kept in the state store, so every frontend that
names the same `--state-store` draws from the same budget.

- SQLite: a table of its own beside the store's entries, each take one `BEGIN IMMEDIATE`
  transaction (the file's write lock: no two frontends take at once).
- Redis: each take one Lua script (Redis runs a script alone), each window's count an
  integer key that expires two windows after it starts.

Either raises `StoreUnavailable` when the store does not answer; the caller's
`--rate-limit-store-failure` decides what that means for the request.
"""

from __future__ import annotations

from frontend.state.store import MemoryStore, RedisStore, SqliteStore, StateStore
from frontend.state.windows import (
    Charge,
    MemoryWindows,
    Taken,
    WindowCounters,
    decide,
    position,
    taken_from,
)

_SCHEMA = """CREATE TABLE IF NOT EXISTS rate_windows (
    key TEXT NOT NULL, idx INTEGER NOT NULL, count INTEGER NOT NULL,
    PRIMARY KEY (key, idx)) WITHOUT ROWID"""
_COUNT = "SELECT count FROM rate_windows WHERE key = ? AND idx = ?"
_ADD = ("INSERT INTO rate_windows VALUES (?, ?, ?) ON CONFLICT (key, idx) "
        "DO UPDATE SET count = count + excluded.count")
_DROP_OLD = "DELETE FROM rate_windows WHERE key = ? AND idx < ?"
_ADJUST = "UPDATE rate_windows SET count = max(0, count + ?) WHERE key = ? AND idx = ?"


class SqliteWindows(WindowCounters):
    shared = True

    def __init__(self, store: SqliteStore, window_s: float = 60.0) -> None:
        super().__init__(window_s)
        self.store = store
        self._ready = False

    def _db(self):
        db = self.store._db  # the store's one connection, under its lock (store._run)
        if not self._ready:
            db.execute(_SCHEMA)
            self._ready = True
        return db

    def _take(self, charges: list[Charge], index: int, fraction: float) -> Taken:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            counts = [tuple(_count(db, c.key, i) for i in (index - 1, index)) for c in charges]
            taken = decide(charges, counts, index, fraction)
            for c in charges:
                if taken.admitted:
                    db.execute(_ADD, (c.key, index, c.cost))
                db.execute(_DROP_OLD, (c.key, index - 1))
            db.execute("COMMIT")
            return taken
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def take(self, charges: list[Charge], now: float) -> Taken:
        index, fraction = position(now, self.window_s)
        return await self.store._run(self._take, charges, index, fraction)

    async def adjust(self, key: str, index: int, delta: int) -> None:
        await self.store._run(lambda: self._db().execute(_ADJUST, (delta, key, index)))


def _count(db, key: str, index: int) -> int:
    row = db.execute(_COUNT, (key, index)).fetchone()
    return row[0] if row else 0


# KEYS: each charge's previous and current window. ARGV: the fraction, each charge's cost and
# limit, the windows' lifetime (ms). Returns every window's count before the take, then 1 if
# taken (0 if not) and the first charge that did not fit (1-based; 0: none).
_TAKE = """
local fraction = tonumber(ARGV[1])
local n = #KEYS / 2
local counts = {}
local refused = 0
for i = 1, n do
  local prev = tonumber(redis.call('GET', KEYS[2 * i - 1]) or '0')
  local curr = tonumber(redis.call('GET', KEYS[2 * i]) or '0')
  counts[2 * i - 1], counts[2 * i] = prev, curr
  local cost, limit = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  if refused == 0 and prev * (1 - fraction) + curr + cost > limit then refused = i end
end
if refused == 0 then
  for i = 1, n do
    redis.call('INCRBY', KEYS[2 * i], ARGV[2 * i])
    redis.call('PEXPIRE', KEYS[2 * i], ARGV[2 * n + 2])
  end
end
counts[2 * n + 1] = refused
return counts
"""
# A settle: only into a window that still exists, and never below zero.
_ADJUST_LUA = """
local count = redis.call('GET', KEYS[1])
if not count then return 0 end
local new = math.max(0, tonumber(count) + tonumber(ARGV[1]))
local ttl = redis.call('PTTL', KEYS[1])
redis.call('SET', KEYS[1], new)
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return new
"""


class RedisWindows(WindowCounters):
    shared = True
    PREFIX = "sluice-rate:"

    def __init__(self, store: RedisStore, window_s: float = 60.0) -> None:
        super().__init__(window_s)
        self.store = store

    def _name(self, key: str, index: int) -> str:
        return f"{self.PREFIX}{key}:{index}"

    async def take(self, charges: list[Charge], now: float) -> Taken:
        index, fraction = position(now, self.window_s)
        keys = [self._name(c.key, i) for c in charges for i in (index - 1, index)]
        args = [repr(fraction), *(str(v) for c in charges for v in (c.cost, c.limit)),
                str(int(self.window_s * 2000))]
        reply = await self.store._call(self.store._redis.eval(_TAKE, len(keys), *keys, *args))
        counts = [(int(reply[2 * i]), int(reply[2 * i + 1])) for i in range(len(charges))]
        # The script decided on the server, atomically: its answer is the one that holds.
        refused = int(reply[-1]) - 1 if int(reply[-1]) else None
        return taken_from(charges, counts, index, fraction, refused)

    async def adjust(self, key: str, index: int, delta: int) -> None:
        await self.store._call(self.store._redis.eval(
            _ADJUST_LUA, 1, self._name(key, index), str(delta)))


def windows_for(store: StateStore, window_s: float = 60.0) -> WindowCounters:
    """The counters over `store`: shared for SQLite and Redis, this process's for memory."""
    if isinstance(store, SqliteStore):
        return SqliteWindows(store, window_s)
    if isinstance(store, RedisStore):
        return RedisWindows(store, window_s)
    if isinstance(store, MemoryStore):
        return MemoryWindows(window_s)
    raise TypeError(f"no rate windows for {type(store).__name__}")
