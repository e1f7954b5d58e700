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
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np


class OutOfPages(Exception):
    pass


PageHash = bytes


def root_hash(cache_salt: str | None, lora_id: int = 0) -> PageHash:
    """The root of a sequence's chain: its salt and, under a LoRA adapter, the adapter's
    engine-unique id (two adapters compute different K/V for the same tokens)."""
    salt = (cache_salt or "").encode()
    if lora_id:
        salt += b"\0lora:%d" % lora_id
    return hashlib.blake2b(salt, digest_size=16, person=b"sluice-root").digest()


def chain_hash(parent: PageHash, tokens) -> PageHash:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.digest()


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

    def register(self, page: int, page_hash: PageHash) -> None:
        """Record that a full page holds the prefix `page_hash` (first writer wins)."""
        if self._hash_of[page] is None and page_hash not in self._page_of:
            self._hash_of[page] = page_hash
            self._page_of[page_hash] = page
