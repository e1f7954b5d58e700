"""Rate windows: a sliding-window counter per key, with every clock reading passed in.

A limit of L per window of W seconds counts what was taken in fixed windows (`index` =
floor(now / W)) and estimates the last W seconds as `prev × (1 − fraction) + curr`, the
previous window's count weighted by how much of it the last W seconds still cover
(Cloudflare's sliding-window counter: two numbers per key, no per-request log). A take of
`cost` fits while estimate + cost ≤ L.

`take` charges several counters (a key's requests and its tokens) all or none: a request
refused for tokens has not spent a request. `adjust` settles a charge later (a tokens
reservation against what the request really used), in the window it was charged to.

`WindowCounters` is the interface; `MemoryWindows` is this process's own. The state store's
shared ones (SQLite, Redis) are in `frontend.state.window_stores`; each does a take as one
atomic step there, so frontends sharing the store share the budget.
"""

from __future__ import annotations

import math

import msgspec


class Charge(msgspec.Struct, frozen=True):
    key: str  # the counter, e.g. "team-a:requests"
    cost: int
    limit: int


class Window(msgspec.Struct, frozen=True):
    """One counter as a take found it (after the take, when admitted)."""

    limit: int
    prev: int
    curr: int
    index: int
    fraction: float  # how far into window `index` the take was, 0..1

    def used(self) -> float:
        return self.prev * (1 - self.fraction) + self.curr

    def remaining(self) -> int:
        return max(0, self.limit - math.ceil(self.used()))


class Taken(msgspec.Struct, frozen=True):
    windows: list[Window]  # one per charge, in order
    refused: int | None = None  # the first charge that did not fit; None: all taken

    @property
    def admitted(self) -> bool:
        return self.refused is None


def position(now: float, window_s: float) -> tuple[int, float]:
    """(window index, fraction of it elapsed) at `now`."""
    index = math.floor(now / window_s)
    return index, now / window_s - index


def fits(prev: int, curr: int, fraction: float, cost: int, limit: int) -> bool:
    return prev * (1 - fraction) + curr + cost <= limit


def retry_after_s(window: Window, cost: int, window_s: float) -> float:
    """Seconds until `cost` more fits, if nothing else is taken meanwhile; a cost above the
    limit never fits: a whole window (and the caller says so)."""
    limit, prev, curr, f = window.limit, window.prev, window.curr, window.fraction
    if cost > limit:
        return window_s
    if curr + cost <= limit:  # fits in this window once enough of `prev` slides out
        g = 1 - (limit - curr - cost) / prev if prev else f
        return max(0.0, (g - f) * window_s)
    # Only in the next window, once enough of this one's count slides out.
    h = 1 - (limit - cost) / curr
    return (1 - f) * window_s + max(0.0, h) * window_s


def reset_s(window: Window, window_s: float) -> float:
    """Seconds until the count is back to nothing (OpenAI's x-ratelimit-reset-*)."""
    left = (1 - window.fraction) * window_s
    if window.curr > 0:
        return left + window_s
    return left if window.prev > 0 else 0.0


class WindowCounters:
    """The interface: `window_s` is the window's length; `now` is unix seconds."""

    shared = False  # whether other frontends see the same counts

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s

    async def take(self, charges: list[Charge], now: float) -> Taken:
        raise NotImplementedError

    async def adjust(self, key: str, index: int, delta: int) -> None:
        raise NotImplementedError


def first_refused(charges: list[Charge], counts: list[tuple[int, int]],
                  fraction: float) -> int | None:
    """The first charge that does not fit, given each one's (prev, curr); None: all fit."""
    return next((i for i, (c, (p, n)) in enumerate(zip(charges, counts, strict=True))
                 if not fits(p, n, fraction, c.cost, c.limit)), None)


def taken_from(charges: list[Charge], counts: list[tuple[int, int]], index: int,
               fraction: float, refused: int | None) -> Taken:
    """The windows after a take that was admitted (refused None) or not."""
    windows = [Window(c.limit, p, n + (c.cost if refused is None else 0), index, fraction)
               for c, (p, n) in zip(charges, counts, strict=True)]
    return Taken(windows, refused)


def decide(charges: list[Charge], counts: list[tuple[int, int]], index: int,
           fraction: float) -> Taken:
    """The take every embedded backend makes, given each charge's (prev, curr) before it."""
    return taken_from(charges, counts, index, fraction, first_refused(charges, counts, fraction))


class MemoryWindows(WindowCounters):
    """This process's counters (`--state-store memory://`): each frontend counts alone."""

    def __init__(self, window_s: float = 60.0) -> None:
        super().__init__(window_s)
        self._counts: dict[tuple[str, int], int] = {}

    async def take(self, charges: list[Charge], now: float) -> Taken:
        index, fraction = position(now, self.window_s)
        counts = [(self._counts.get((c.key, index - 1), 0), self._counts.get((c.key, index), 0))
                  for c in charges]
        taken = decide(charges, counts, index, fraction)
        if taken.admitted:
            for c in charges:
                self._counts[(c.key, index)] = self._counts.get((c.key, index), 0) + c.cost
        self._forget_before(index - 1)
        return taken

    async def adjust(self, key: str, index: int, delta: int) -> None:
        if (key, index) in self._counts:
            self._counts[(key, index)] = max(0, self._counts[(key, index)] + delta)

    def _forget_before(self, index: int) -> None:
        if len(self._counts) > 4096:  # now and then, not on every take
            for k in [k for k in self._counts if k[1] < index]:
                del self._counts[k]
