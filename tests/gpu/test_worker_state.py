"""gpu/worker_state.py's release_free_heap: the load's freed temporaries go back to the system
instead of staying in the worker's resident memory."""

from __future__ import annotations

import ctypes

import psutil
import pytest

from gpu.worker_state import release_free_heap


def test_freed_heap_memory_leaves_the_resident_set():
    try:
        ctypes.CDLL(None).malloc_trim
    except AttributeError:
        pytest.skip("this C library has no malloc_trim")
    proc = psutil.Process()
    # 96 MB in 64 KB blocks (below glibc's mmap threshold: on the heap), then one small block
    # above them, so the heap's top is in use and glibc cannot shrink it on its own.
    blocks = [ctypes.create_string_buffer(64 << 10) for _ in range(1536)]
    for block in blocks:
        ctypes.memset(block, 1, len(block))  # resident
    pin = ctypes.create_string_buffer(64)
    del blocks
    freed = proc.memory_info().rss
    release_free_heap()
    released = freed - proc.memory_info().rss
    assert released > 64 << 20, f"only {released >> 20} MB of 96 freed MB left the resident set"
    del pin
