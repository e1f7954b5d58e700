"""Page bookkeeping for the paged KV cache: a free list and reference counts.

The tensors themselves live with the attention backend; this module only decides which page
ids a sequence owns. Reference counts exist so pages can be shared (prefix caching, n > 1):
a page returns to the free list when its last owner lets go.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(Exception):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"need {count} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._refcount[page] = 1
        return pages

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
                self._free.append(page)
