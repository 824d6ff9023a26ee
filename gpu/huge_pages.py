"""The weights' codes in transparent huge pages. Every decode step streams each weight's codes
once, and with 4 KiB pages those reads cross a page (and miss the TLB) every 4 KiB: Gemma 3's
262,144 x 640 lm_head argmax at one row took 5.6 ms from 4 KiB pages and 4.7 from huge ones,
SmolLM2's whole step at one stream ~15% less. The kernel's default mode ("madvise") gives huge
pages only to memory advised so, and advising the whole process was slower (every step's large
scratch then comes as fresh 2 MiB pages): so the codes alone are advised.

While a model loads (`codes_in_huge_pages`), its codes are laid one after another in one
buffer whose whole 2 MiB pages are advised: a small model's projections are a few hundred KB
each, too small for a huge page of their own. Outside a load, a tensor of 4 MiB and more gets
a buffer of its own (only its aligned inside advised: no page holds anything else).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ipc.process_heap import madvise

# madvise's advice number (Linux) and the size of a transparent huge page (x86-64, arm64 4K).
MADV_HUGEPAGE = 14
HUGE_PAGE_BYTES = 2 << 20
# Where each tensor starts in a load's buffer: the kernels' vector loads want no more.
ALIGN = 64


def advise_huge(start: int, end: int) -> bool:
    """Advise the whole 2 MiB pages inside [start, end); whether any were (Linux only)."""
    start = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return end > start and madvise(start, end - start, MADV_HUGEPAGE)


class _LoadBuffer:
    """One buffer of `capacity` bytes (not yet touched: only what is copied in becomes
    resident) from which a load's codes are taken in order."""

    def __init__(self, capacity: int) -> None:
        try:
            self.buffer = torch.empty(capacity + HUGE_PAGE_BYTES, dtype=torch.uint8)
        except RuntimeError:  # no address space for it (a strict overcommit policy): as before
            self.buffer, self.used, self.advised = torch.empty(0, dtype=torch.uint8), 0, False
            return
        self.used = -self.buffer.data_ptr() % HUGE_PAGE_BYTES  # from a page's start
        ptr = self.buffer.data_ptr()
        self.advised = advise_huge(ptr, ptr + self.buffer.numel())

    def take(self, t: torch.Tensor) -> torch.Tensor | None:
        """A copy of t in the buffer, None where it is full."""
        at = -(-self.used // ALIGN) * ALIGN
        if not self.advised or at + t.nbytes > self.buffer.numel():
            return None
        self.used = at + t.nbytes
        return self.buffer[at:self.used].view(t.dtype).view(t.shape).copy_(t)


_load_buffer: ContextVar[_LoadBuffer | None] = ContextVar("codes_load_buffer", default=None)


@contextmanager
def codes_in_huge_pages(capacity: int) -> Iterator[None]:
    """While this holds, `in_huge_pages` lays codes one after another in one buffer of
    `capacity` bytes (the most the load's codes can take; only what they take becomes
    resident, and its last huge page at most half-filled on average). The buffer lives as
    long as any tensor in it: the model's."""
    token = _load_buffer.set(_LoadBuffer(capacity) if capacity > 0 else None)
    try:
        yield
    finally:
        _load_buffer.reset(token)


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor copied where its pages are advised huge: into the load's
    buffer (`codes_in_huge_pages`), or, 4 MiB and more, into a buffer of its own. `t` itself
    where neither applies (small outside a load, not on the CPU, no madvise)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return t
    buffer = _load_buffer.get()
    if buffer is not None and (placed := buffer.take(t)) is not None:
        return placed
    if t.nbytes < 2 * HUGE_PAGE_BYTES:
        return t
    out = torch.empty_like(t)  # its own mapping, not yet touched
    if not advise_huge(out.data_ptr(), out.data_ptr() + out.nbytes):
        return t
    return out.copy_(t)
