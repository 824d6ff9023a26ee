"""gpu/heap.py: the load's freed temporaries go back to the system instead of staying in the
worker's resident memory, and so do large freed buffers (a prefill's activations) once the
worker maps them on their own."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import psutil
import pytest

from fmserve.engine import Engine
from gpu import heap
from gpu import worker as worker_module
from gpu.heap import release_free_heap
from gpu.plain_step import PlainStep
from gpu.worker import Worker
from ipc.sampling import SamplingParams
from ipc.worker_config import worker_config


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


def test_the_worker_hands_back_what_building_its_step_freed(tiny_llama, monkeypatch):
    """A step's construction (an EAGLE head's load and first forwards) frees what it built
    with: the worker trims its heap once the step exists. Here the step leaves 96 MB freed but
    resident, pinned under a live block as a head's load leaves it."""
    needs_malloc_trim()
    proc, seen = psutil.Process(), {}

    class LeavesFreedMemory(PlainStep):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            seen["pin"] = freed_heap_blocks()
            seen["rss"] = proc.memory_info().rss

    monkeypatch.setattr(worker_module, "PlainStep", LeavesFreedMemory)
    Worker(worker_config(model_path=str(tiny_llama), dtype="fp32", attention_backend="torch"))
    released = seen["rss"] - proc.memory_info().rss
    assert released > 64 << 20, f"only {released >> 20} MB of 96 freed MB left the resident set"


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
