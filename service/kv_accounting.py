"""Host-side bookkeeping of KV pages and request slots (no device memory here).

The scheduler decides who owns what; the worker applies the decisions it receives in plans.
Page 0 and slot 0 are reserved padding and are never handed out.
"""

from __future__ import annotations

import heapq


class OutOfPages(Exception):
    pass


class _FreeList:
    """Numbers 1 .. total - 1, the lowest free one handed out first (0 is reserved padding).

    Lowest first, not oldest-freed first: the KV pool is allocated untouched, and a page
    becomes resident memory the first time it is written. Handing out the lowest pages keeps
    the resident part of the pool to the most pages ever in use at once; cycling through the
    free list touched all of it over time (a 65,536-token pool grew the worker by ~24 KB a
    decoded token until the whole 1.5 GB was resident)."""

    def __init__(self, total: int, what: str, one: str) -> None:
        if total < 2:
            raise ValueError(f"need at least 2 {what} ({one} 0 is reserved), got {total}")
        self._free: list[int] = list(range(1, total))  # a heap; sorted is one already
        self._total = total

    def _take(self) -> int:
        return heapq.heappop(self._free)

    def _give(self, number: int) -> None:
        heapq.heappush(self._free, number)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self._total - 1


class PageAllocator(_FreeList):
    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, "KV pages", "page")
        self.num_pages = num_pages
        self.page_size = page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free")
        return [self._take() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        for page in pages:
            self._give(page)


class SlotAllocator(_FreeList):
    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, "request slots", "slot")
        self.num_slots = num_slots

    def allocate(self) -> int | None:
        return self._take() if self._free else None

    def free(self, slot: int) -> None:
        self._give(slot)
