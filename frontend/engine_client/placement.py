"""Which engine a request goes to: pure policy, no sockets (the engine client feeds it).

`prefix` (the default) is rendezvous hashing with a load bound. A request's key is a hash of
its first pages of prompt tokens and its `cache_salt`, so every turn of a conversation (each
re-sends the same history) and every request behind a shared system prompt names the same
key, and every frontend, hashing the same engine ids, ranks the engines in the same order
for it. The request goes to the first engine in that order whose load is within the bound,
`load_factor` × the mean load (after this request) rounded up: affinity never piles work
onto a hot engine, and when the preferred engine is over the bound the key spills to its
second choice, the same one for every frontend (bounded-load consistent hashing, Mirrokni
et al. 2018, over rendezvous rather than a ring). An engine whose KV cache is nearly full
while requests wait is skipped too. `least-loaded` takes the engine with the least load (KV
use breaks ties), `round-robin` cycles. Only live engines are candidates.

`kv` knows rather than guesses: the engines' KV events (`kv_index.py`) say how many of the
prompt's leading pages each engine holds (`cached_pages`), whoever sent them there. The
request goes to the engine holding the longest run, within the same load bound (ties in
rendezvous order); when no engine within the bound holds any, it is placed as `prefix`.
TensorRT-LLM's per-request fields steer it (`RoutingHints`): a conversation id replaces the
prompt's pages as the affinity key, so a conversation stays on one engine even as its
history is cut or rewritten; a pinned engine (scheduling_params.attention_dp_rank, an engine
by its place in --engine-address order) takes the request whatever the policy, or, relaxed,
only while it is live and within the load bound.

Load is waiting + running requests from the engine's last heartbeat, corrected by what this
frontend sent it since (heartbeats lag by up to a second, and a burst must not all land on
the engine whose heartbeat is oldest).
"""

from __future__ import annotations

import hashlib
import itertools
import math

import msgspec

POLICIES = ("prefix", "least-loaded", "round-robin", "kv")
# Full pages of prompt the key covers: a shared system prompt, or a chat's first turn, which
# every later turn of that chat re-sends. Few, so the key stays the same as a chat grows.
AFFINITY_PAGES = 2
DEFAULT_PAGE_SIZE = 16  # until an engine's heartbeat says its own
KV_FULL = 0.95  # KV use at which an engine with waiting requests takes no affinity traffic


class Candidate(msgspec.Struct, frozen=True):
    """One engine as placement sees it."""

    name: str  # what the hash ranks: the engine's id (its address until it has spoken)
    load: int  # waiting + running requests, as best known now
    kv_use: float = 0.0  # share of KV pages in use, 0..1
    waiting: int = 0
    cached_pages: int = 0  # `kv`: the prompt's leading pages its KV events say it holds


class RoutingHints(msgspec.Struct, frozen=True):
    """What a request's conversation_params and scheduling_params ask of placement."""

    affinity: str | None = None  # a conversation (or its parent session) id
    engine_rank: int | None = None  # the pinned engine's place in --engine-address order
    relax: bool = False  # the pin may yield to load or to an engine that is not live


class PinnedUnavailable(Exception):
    """A strict pin names an engine that is not live."""


def conversation_key(conversation: str, cache_salt: str | None) -> bytes:
    """The affinity key of a conversation id (with the salt, as the prefix key)."""
    digest = hashlib.blake2b(b"conversation:" + conversation.encode(), digest_size=16)
    digest.update(b"\x00salt:" + (cache_salt or "").encode())
    return digest.digest()


def prefix_key(prompt_ids: bytes, cache_salt: str | None,
               page_size: int = DEFAULT_PAGE_SIZE, pages: int = AFFINITY_PAGES) -> bytes:
    """The affinity key: a digest of the prompt's first `pages` full pages (int32 token
    bytes; fewer if that is all it has, the whole prompt if not one) and its salt, which
    keeps tenants' caches apart. Full pages only, because only those are cached: a first
    turn of 40 tokens and its next turn of 90 share two 16-token pages, hence a key."""
    page = 4 * max(1, page_size)
    full = min(max(1, pages), len(prompt_ids) // page)
    head = prompt_ids[: full * page] if full else prompt_ids
    digest = hashlib.blake2b(head, digest_size=16)
    digest.update(b"\x00salt:" + (cache_salt or "").encode())
    return digest.digest()


def _score(key: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + name.encode(), digest_size=8).digest(), "big")


def rank(key: bytes, names: list[str]) -> list[str]:
    """Rendezvous order: the engines by descending hash of (key, engine); ties by name."""
    return sorted(names, key=lambda n: (-_score(key, n), n))


def load_bound(candidates: list[Candidate], load_factor: float) -> int:
    """The most requests an engine may hold and still take affinity traffic: load_factor ×
    the mean load counting the request being placed, rounded up (never below 1)."""
    total = sum(c.load for c in candidates) + 1
    return max(1, math.ceil(load_factor * total / len(candidates)))


class Placement:
    def __init__(self, policy: str = "prefix", load_factor: float = 1.25) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}: {policy!r}")
        if load_factor < 1.0:
            raise ValueError("load_factor must be at least 1")
        self.policy = policy
        self.load_factor = load_factor
        self._turn = itertools.count()

    def choose_pinned(self, name: str | None, relax: bool,
                      candidates: list[Candidate]) -> str | None:
        """The pinned engine `name` (None: no engine has that rank) if it may take the
        request; None to place it as usual (a relaxed pin on an engine not live or past
        the load bound). PinnedUnavailable when a strict pin's engine is not live."""
        pinned = next((c for c in candidates if c.name == name), None)
        if pinned is None:
            if relax:
                return None
            raise PinnedUnavailable("the engine scheduling_params.attention_dp_rank names "
                                    "is not available; set attention_dp_relax to let the "
                                    "request go to another")
        if relax and pinned.load >= load_bound(candidates, self.load_factor):
            return None
        return pinned.name

    def choose(self, key: bytes, candidates: list[Candidate]) -> str | None:
        """The engine for a request with affinity `key` among the live `candidates`;
        None when there is none."""
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0].name
        if self.policy == "round-robin":
            ordered = sorted(c.name for c in candidates)
            return ordered[next(self._turn) % len(ordered)]
        if self.policy in ("prefix", "kv"):
            bound = load_bound(candidates, self.load_factor)
            by_name = {c.name: c for c in candidates}
            open_ = [by_name[name] for name in rank(key, list(by_name))
                     if by_name[name].load < bound
                     and not (by_name[name].kv_use >= KV_FULL and by_name[name].waiting > 0)]
            if self.policy == "kv" and open_ and max(c.cached_pages for c in open_) > 0:
                return max(open_, key=lambda c: c.cached_pages).name  # first of the ties
            if open_:
                return open_[0].name
        return least_loaded(candidates)


def least_loaded(candidates: list[Candidate]) -> str:
    return min(candidates, key=lambda c: (c.load, c.kv_use, c.name)).name
