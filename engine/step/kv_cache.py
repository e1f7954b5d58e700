"""Page bookkeeping for the paged KV cache: free list, reference counts, prefix cache.

The tensors themselves live with the attention backend; this module only decides which page
ids a sequence owns. Reference counts let pages be shared: a page returns to the pool when
its last owner lets go.

Prefix caching: every full page of a sequence gets a hash chained over all tokens before it
and rooted at the request's cache_salt and LoRA adapter, so two requests share a page only
when everything up to and including that page is identical *and* their salts (and adapters)
match (tenants never share). A
released page that holds a hash is not wiped: it waits in an LRU of cached free pages and is
reused as is by the next request with that prefix, or recycled, oldest first, when no plain
free page is left.

KV-cache events (`--kv-events-config`, shared.kv_events): with an `events` log, the cache
records what a KV-aware router needs, as vLLM's events: `BlockStored` when full pages enter
it (the scheduler registers them, knowing their tokens), `BlockRemoved` when a cached page
is recycled, `AllBlocksCleared` when it starts empty. The engine publishes the log once per
step. An offload tier or a KV transfer that lands pages records into a log of its own
medium (`KvEventLog(MEDIUM_CPU)`): that is the hook they take (none exists yet).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from shared.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from shared.page_hash import PageHash, chain_hash, external_hash, root_hash

__all__ = ["KvEventLog", "OutOfPages", "PageAllocator", "PageHash", "chain_hash", "root_hash"]


class OutOfPages(Exception):
    pass


class KvEventLog:
    """The cache's changes since the publisher last took them, in order."""

    def __init__(self, medium: str = MEDIUM_GPU) -> None:
        self.medium = medium
        self._events: list[KVEvent] = []

    def stored(self, hashes: list[PageHash], indices: list[int], token_ids, page_size: int,
               lora_id: int = 0, lora_name: str | None = None) -> None:
        """Pages `indices` of a sequence (its page hashes, its tokens) entered the cache: one
        BlockStored per run of consecutive pages, as vLLM sends a request's new blocks."""
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self._events.append(BlockStored(
                block_hashes=[external_hash(hashes[i]) for i in run],
                parent_block_hash=external_hash(hashes[first - 1]) if first else None,
                token_ids=list(token_ids[first * page_size:(last + 1) * page_size]),
                block_size=page_size, lora_id=lora_id or None, medium=self.medium,
                lora_name=lora_name))

    def removed(self, page_hash: PageHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # a step's evictions travel as one event
            last.block_hashes.append(external_hash(page_hash))
        else:
            self._events.append(BlockRemoved([external_hash(page_hash)], self.medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages
        self._hash_of: list[PageHash | None] = [None] * num_pages
        self._page_of: dict[PageHash, int] = {}
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.events: KvEventLog | None = None  # set: --kv-events-config records changes

    @property
    def num_free(self) -> int:
        """Pages a new request can take: plain free ones plus cached ones nobody owns."""
        return len(self._free) + len(self._cached_free)

    def refcount(self, page: int) -> int:
        """How many sequences own `page` (0: free)."""
        return self._refcount[page]

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfPages(f"need {count} pages, {self.num_free} free")
        pages = [self._take_one() for _ in range(count)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def _take_one(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._cached_free.popitem(last=False)
        del self._page_of[self._hash_of[page]]
        if self.events is not None:
            self.events.removed(self._hash_of[page])
        self._hash_of[page] = None
        return page

    def share(self, pages: list[int]) -> None:
        for page in pages:
            if self._refcount[page] == 0:
                raise ValueError(f"page {page} is free and cannot be shared")
            self._refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            count = self._refcount[page]
            if count <= 0:
                raise ValueError(f"page {page} released more often than taken")
            self._refcount[page] = count - 1
            if count == 1:
                if self._hash_of[page] is None:
                    self._free.append(page)
                else:
                    self._cached_free[page] = None

    # ---------------------------------------------------------------- prefix cache

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's /reset_prefix_cache), only when no sequence owns
        a page: a running request's pages stay addressed by their hashes. The number of
        owned pages (0: done, the cache is empty and AllBlocksCleared recorded)."""
        owned = sum(1 for count in self._refcount if count > 0)
        if owned:
            return owned
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        self._page_of.clear()
        self._hash_of = [None] * self.num_pages
        if self.events is not None:
            self.events.cleared()
        return 0

    def cached_prefix(self, hashes: list[PageHash]) -> list[int]:
        """Take the longest run of leading pages already cached; the caller owns them now."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            if self._refcount[page] == 0:
                del self._cached_free[page]
            self._refcount[page] += 1
            pages.append(page)
        self.prefix_queries += len(hashes) * self.page_size
        self.prefix_hits += len(pages) * self.page_size
        return pages

    def register(self, page: int, page_hash: PageHash) -> bool:
        """Record that a full page holds the prefix `page_hash` (first writer wins); whether
        the cache holds a new prefix now."""
        if self._hash_of[page] is None and page_hash not in self._page_of:
            self._hash_of[page] = page_hash
            self._page_of[page_hash] = page
            return True
        return False
