"""The page and slot free lists: what they hand out, and that they keep the KV pool's touched
part small (the lowest free numbers first)."""

import random

import pytest

from service.kv_accounting import OutOfPages, PageAllocator, SlotAllocator


def test_pages_are_handed_out_lowest_first_and_never_page_zero():
    pages = PageAllocator(num_pages=10, page_size=16)
    assert pages.allocate(3) == [1, 2, 3]
    first = pages.allocate(2)
    pages.free([2, 1])
    assert pages.allocate(3) == [1, 2, 6]
    assert 0 not in first and pages.num_free == 9 - 6


def test_cycling_requests_stay_within_the_most_pages_in_use_at_once():
    # Requests of random lengths come and go, never more than 40 pages in use together: the
    # pages ever handed out stay within the first 40 of a 4096-page pool, so only that much
    # of the pool is ever written (resident). Oldest-freed-first walked over all of it.
    rng = random.Random(0)
    pages = PageAllocator(num_pages=4096, page_size=16)
    live: list[list[int]] = []
    touched: set[int] = set()
    for _ in range(5000):
        in_use = sum(map(len, live))
        want = rng.randint(1, 8)
        if live and (in_use + want > 40 or rng.random() < 0.5):
            pages.free(live.pop(rng.randrange(len(live))))
            continue
        got = pages.allocate(want)
        touched.update(got)
        live.append(got)
    assert max(touched) <= 40 and pages.num_free + sum(map(len, live)) == 4095


def test_too_many_pages_is_refused_and_loses_none():
    pages = PageAllocator(num_pages=5, page_size=16)
    with pytest.raises(OutOfPages, match="asked for 5 KV pages, 4 free"):
        pages.allocate(5)
    assert pages.allocate(4) == [1, 2, 3, 4]


def test_slots_are_reused_lowest_first():
    slots = SlotAllocator(num_slots=4)
    assert [slots.allocate() for _ in range(4)] == [1, 2, 3, None]
    slots.free(3)
    slots.free(1)
    assert slots.allocate() == 1 and slots.num_free == 1
