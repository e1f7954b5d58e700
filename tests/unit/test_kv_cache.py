"""PageAllocator: the free list and reference counts behind the paged KV cache."""

import pytest

from engine.step.kv_cache import OutOfPages, PageAllocator


def test_starts_all_free():
    alloc = PageAllocator(num_pages=8, page_size=16)
    assert alloc.num_free == 8
    assert alloc.num_pages == 8 and alloc.page_size == 16


@pytest.mark.parametrize("num_pages,page_size", [(0, 16), (8, 0), (-1, 4)])
def test_rejects_non_positive_sizes(num_pages, page_size):
    with pytest.raises(ValueError):
        PageAllocator(num_pages, page_size)


@pytest.mark.parametrize(
    "num_tokens,expected", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)]
)
def test_pages_needed_rounds_up(num_tokens, expected):
    assert PageAllocator(4, 16).pages_needed(num_tokens) == expected


def test_allocate_hands_out_distinct_pages():
    alloc = PageAllocator(8, 4)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert sorted(a + b) == list(range(8))
    assert alloc.num_free == 0


def test_allocate_zero_is_a_no_op():
    alloc = PageAllocator(2, 4)
    assert alloc.allocate(0) == []
    assert alloc.num_free == 2


def test_out_of_pages_takes_nothing():
    alloc = PageAllocator(4, 4)
    alloc.allocate(3)
    with pytest.raises(OutOfPages):
        alloc.allocate(2)
    # The failed request must not have taken the last free page.
    assert alloc.num_free == 1
    assert len(alloc.allocate(1)) == 1


def test_release_returns_pages_for_reuse():
    alloc = PageAllocator(4, 4)
    pages = alloc.allocate(4)
    alloc.release(pages[:2])
    assert alloc.num_free == 2
    again = alloc.allocate(2)
    assert sorted(again) == sorted(pages[:2])
    with pytest.raises(OutOfPages):
        alloc.allocate(1)


def test_double_release_raises():
    alloc = PageAllocator(4, 4)
    pages = alloc.allocate(2)
    alloc.release(pages)
    with pytest.raises(ValueError):
        alloc.release(pages[:1])
    assert alloc.num_free == 4


def test_release_of_never_allocated_page_raises():
    alloc = PageAllocator(4, 4)
    with pytest.raises(ValueError):
        alloc.release([0])
    assert alloc.num_free == 4


def test_shared_page_freed_only_by_last_owner():
    alloc = PageAllocator(4, 4)
    pages = alloc.allocate(2)
    alloc.share(pages)  # refcount 2
    alloc.share(pages[:1])  # page 0: refcount 3
    alloc.release(pages)
    assert alloc.num_free == 2  # both still owned
    alloc.release(pages)
    # pages[1] had two owners, pages[0] three: only pages[1] is back.
    assert alloc.num_free == 3
    alloc.release(pages[:1])
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.release(pages[:1])


def test_shared_page_is_not_handed_out_again():
    alloc = PageAllocator(2, 4)
    [page] = alloc.allocate(1)
    alloc.share([page])
    alloc.release([page])
    [other] = alloc.allocate(1)
    assert other != page
    with pytest.raises(OutOfPages):
        alloc.allocate(1)


def test_share_of_free_page_raises():
    alloc = PageAllocator(4, 4)
    with pytest.raises(ValueError):
        alloc.share([1])
    pages = alloc.allocate(1)
    alloc.release(pages)
    with pytest.raises(ValueError):
        alloc.share(pages)
    assert alloc.num_free == 4
