"""gpu/heap.py: the load's freed temporaries go back to the system instead of staying in the
worker's resident memory, and so do large freed buffers (a prefill's activations) once the
worker maps them on their own; large codes sit in memory advised for huge pages."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from fmserve.engine import Engine
from gpu import heap
from gpu.codes_layout import Q8Rows
from gpu.heap import release_free_heap
from ipc.sampling import SamplingParams
from tests.gpu.test_q4_linear import int4, quantized


def needs_malloc_trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim
    except AttributeError:
        pytest.skip("this C library has no malloc_trim")


def freed_heap_blocks() -> ctypes.Array:
    """96 MB in 64 KB blocks (below glibc's mmap threshold: on the heap), made resident, and
    all but the last freed: the last (returned: keep it) holds the heap's top in use, so
    glibc cannot shrink the heap on its own."""
    blocks = [ctypes.create_string_buffer(64 << 10) for _ in range(1536)]
    for block in blocks:
        ctypes.memset(block, 1, len(block))  # resident
    return blocks[-1]


def test_freed_heap_memory_leaves_the_resident_set():
    needs_malloc_trim()
    proc = psutil.Process()
    pin = freed_heap_blocks()
    freed = proc.memory_info().rss
    release_free_heap()
    released = freed - proc.memory_info().rss
    assert released > 64 << 20, f"only {released >> 20} MB of 96 freed MB left the resident set"
    del pin


@pytest.mark.parametrize("worker_process", [True, False])
def test_a_worker_process_trims_its_heap_after_a_prefill_step(model_path, monkeypatch,
                                                               worker_process):
    """A step with prefill chunks in a worker process (map_large_buffers took) hands freed
    heap memory back; the offline engine inside a user's process leaves the heap alone."""
    needs_malloc_trim()
    monkeypatch.setattr(heap, "_worker_heap", worker_process)
    monkeypatch.setattr(heap, "TRIM_EVERY_S", 0.0)
    engine = Engine(model=str(model_path), dtype="fp32", max_kv_tokens=1024, progress=False)
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    engine.generate(["Hi"], params)  # the steps' own buffers, once

    def released_by_a_prefill() -> int:
        proc = psutil.Process()
        pin = freed_heap_blocks()
        freed = proc.memory_info().rss
        engine.generate(["Hello there"], params)  # one prefill step
        del pin
        return freed - proc.memory_info().rss

    released = released_by_a_prefill()
    if worker_process:
        assert released > 64 << 20, f"only {released >> 20} MB of 96 freed MB were handed back"
        # At most one trim in TRIM_EVERY_S: the next prefill, this soon, leaves the heap be.
        monkeypatch.setattr(heap, "TRIM_EVERY_S", 600.0)
        released = released_by_a_prefill()
    assert released < 32 << 20, f"{released >> 20} MB handed back, with no trim due"


# In a process of its own (the setting is process-wide): a 24 MiB buffer freed (glibc's own
# threshold then rises to 24 MiB), then a 16 MiB one filled and freed under a small block that
# pins the heap's top. Prints how many MiB of the 16 stayed resident.
RETAINED = """
import ctypes, sys
import psutil
from gpu.heap import map_large_buffers
if sys.argv[1] == "mapped":
    assert map_large_buffers()
libc, proc = ctypes.CDLL(None), psutil.Process()
libc.malloc.restype = ctypes.c_void_p
libc.free(ctypes.c_void_p(libc.malloc(24 << 20)))
before = proc.memory_info().rss
buf = libc.malloc(16 << 20)
ctypes.memset(buf, 1, 16 << 20)
pin = libc.malloc(64)
libc.free(ctypes.c_void_p(buf))
print((proc.memory_info().rss - before) >> 20)
"""


def retained_mib(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", RETAINED, mode], capture_output=True,
                         text=True, check=True, timeout=60)
    return int(out.stdout.strip())


def test_large_freed_buffers_leave_the_resident_set_once_mapped_on_their_own():
    try:
        ctypes.CDLL(None).mallopt
    except AttributeError:
        pytest.skip("this C library has no mallopt")
    assert retained_mib("default") >= 12  # glibc's rising threshold: the heap kept it
    assert retained_mib("mapped") <= 2


_HUGE_PAGES_PROBE = """
import torch
from gpu import heap
from gpu.codes_layout import Q8Rows
from tests.gpu.test_heap import advised_huge
from tests.gpu.test_q4_linear import int4, quantized

def inside(t):
    return -(-t.data_ptr() // heap.HUGE_PAGE_BYTES) * heap.HUGE_PAGE_BYTES

big = torch.randint(-128, 128, (4096, 1280), dtype=torch.int8)  # 5 MiB
moved = heap.in_huge_pages(big)
assert moved.data_ptr() != big.data_ptr() and torch.equal(moved, big)
assert advised_huge(inside(moved)) and not advised_huge(inside(big))
small = torch.zeros(1024, 1024, dtype=torch.int8)
assert heap.in_huge_pages(small) is small
raw, exact = quantized("Q8_0", rows=4096, cols=1024)  # the 8-bit kernel's codes: 4 MiB
codes = Q8Rows.from_pair(int4(raw, "Q8_0", exact.shape))
assert advised_huge(inside(codes.codes)) and torch.equal(codes.dequantize(), exact)
print("ok")
"""


def advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` is advised MADV_HUGEPAGE ("hg" in its VmFlags)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc only")
def test_large_codes_are_copied_into_memory_advised_for_huge_pages():
    """A weight's codes of 4 MiB and more are copied into memory advised for transparent huge
    pages (whole 2 MiB pages inside the copy only); smaller ones stay where they are. In a
    fresh process: in this one, heap ranges that earlier tests' models advised are reused."""
    run = subprocess.run([sys.executable, "-c", _HUGE_PAGES_PROBE], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
