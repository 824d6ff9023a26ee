"""Host-side bookkeeping of KV pages and request slots (no device memory here).

The scheduler decides who owns what; the worker applies the decisions it receives in plans.
Page 0 and slot 0 are reserved padding and are never handed out.
"""

from __future__ import annotations

from collections import deque


class OutOfPages(Exception):
    pass


class _FreeList:
    """Numbers 1 .. total - 1, handed out oldest-freed first (0 is reserved padding)."""

    def __init__(self, total: int, what: str, one: str) -> None:
        if total < 2:
            raise ValueError(f"need at least 2 {what} ({one} 0 is reserved), got {total}")
        self._free: deque[int] = deque(range(1, total))
        self._total = total

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
        return [self._free.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


class SlotAllocator(_FreeList):
    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, "request slots", "slot")
        self.num_slots = num_slots

    def allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)
