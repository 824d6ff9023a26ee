"""What a worker's freed memory costs: glibc keeps freed heap blocks resident for reuse, which
for a CPU worker of a small model is a large share of its resident set (release_free_heap:
ipc/process_heap.py, which the service uses too)."""

from __future__ import annotations

import ctypes
import math
import time

from ipc.process_heap import release_free_heap

__all__ = ["release_free_heap", "map_large_buffers", "trim_after_prefill"]

# mallopt's parameter number (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
# Buffers of this size and more get mappings of their own (map_large_buffers).
LARGE_BUFFER_BYTES = 4 << 20
# Whether this process's heap is a worker's own (map_large_buffers took): then the worker also
# trims it after steps with prefill chunks (trim_after_prefill), at most once in TRIM_EVERY_S:
# a trim takes ~1.5 ms (10 at most), and under load most steps carry a chunk.
_worker_heap = False
TRIM_EVERY_S = 0.25
_last_trim = -math.inf


def map_large_buffers(threshold: int = LARGE_BUFFER_BYTES) -> bool:
    """Allocations of `threshold` bytes and more get mappings of their own, unmapped (gone
    from the resident set) when freed. glibc's own threshold rises, up to 32 MiB, with each
    such buffer freed, after which a prefill's activations came from the heap and stayed
    resident: SmolLM2-135M at 32 streams on the 2-core AVX2 EPYC peaked ~45 MB higher. Smaller
    buffers (a decode step's) stay on the heap, where reuse costs no page faults. Process-wide:
    the worker process sets it, not the offline engine inside a user's. Returns whether the C
    library took it (False where it has no mallopt)."""
    global _worker_heap
    try:
        _worker_heap = ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold) == 1
    except (OSError, AttributeError):
        _worker_heap = False
    return _worker_heap


def trim_after_prefill() -> None:
    """After a step with prefill chunks, in a worker process: a prefill's buffers under
    LARGE_BUFFER_BYTES are freed into the heap among blocks still in use, where glibc keeps
    them resident. SmolLM2-135M served on the 2-core AVX512-BF16 EPYC at 1, 8 and 32 streams:
    peak RSS 656-668 -> 601-603 MB trimming after every such step (malloc_trim 1.5 ms median,
    10.6 at most, ~46 a run of 3 x 16 requests), 595-602 MB at most every 0.25 s; throughput
    within noise either way."""
    global _last_trim
    now = time.monotonic()
    if _worker_heap and now - _last_trim >= TRIM_EVERY_S:
        _last_trim = now
        release_free_heap()
