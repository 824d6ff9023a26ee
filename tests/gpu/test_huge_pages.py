"""gpu/huge_pages.py: the weights' codes sit in memory advised for transparent huge pages, a
load's codes one after another in one buffer, a large tensor outside a load in its own.

Each check runs in a fresh process: in this one, heap ranges that earlier tests' models
advised are reused, and a plain buffer could sit in one of them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(),
                                reason="reads Linux's /proc/self/smaps")

_HELPERS = """
import torch
from gpu import huge_pages
from gpu.huge_pages import HUGE_PAGE_BYTES, codes_in_huge_pages, in_huge_pages

def advised(address):
    # whether the mapping holding `address` is advised MADV_HUGEPAGE ("hg" in its VmFlags)
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

def page_inside(t):
    return -(-t.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
"""


def run_probe(body: str) -> None:
    run = subprocess.run([sys.executable, "-c", _HELPERS + body + "\nprint('ok')"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_a_large_tensor_outside_a_load_gets_a_buffer_of_its_own_advised_huge():
    """4 MiB and more: copied (equal) into memory whose whole 2 MiB pages are advised; smaller
    ones stay where they are."""
    run_probe("""
big = torch.randint(-128, 128, (4096, 1280), dtype=torch.int8)  # 5 MiB
moved = in_huge_pages(big)
assert moved.data_ptr() != big.data_ptr() and torch.equal(moved, big)
assert advised(page_inside(moved)) and not advised(page_inside(big))
small = torch.zeros(1024, 1024, dtype=torch.int8)
assert in_huge_pages(small) is small
""")


def test_a_loads_codes_go_one_after_another_into_one_advised_buffer():
    """Inside `codes_in_huge_pages`, small tensors of any dtype are copied (equal) into one
    advised buffer, 64-byte aligned, one after another; one that no longer fits, and any
    after the load, are placed as outside a load; the buffer outlives the load."""
    run_probe("""
parts = [torch.randint(0, 255, (16, 1000), dtype=torch.uint8), torch.randn(333),
         torch.randint(-128, 128, (48, 96), dtype=torch.int8)]
with codes_in_huge_pages(3 << 20):
    placed = [in_huge_pages(t) for t in parts]
    too_big = torch.zeros(4 << 20, dtype=torch.uint8)
    assert in_huge_pages(too_big).data_ptr() != too_big.data_ptr()  # its own buffer
base = placed[0].untyped_storage().data_ptr()
assert all(p.untyped_storage().data_ptr() == base for p in placed)
assert all(torch.equal(p, t) and p.dtype == t.dtype for p, t in zip(placed, parts))
starts = [p.data_ptr() for p in placed]
assert starts[0] % HUGE_PAGE_BYTES == 0 and all(s % 64 == 0 for s in starts)
assert starts[1] == starts[0] + 16000 and starts[2] == starts[1] + 64 * -(-333 * 4 // 64)
assert advised(starts[0])
after = torch.randint(0, 255, (16, 1000), dtype=torch.uint8)
assert in_huge_pages(after) is after  # small, outside a load
del parts
assert torch.equal(placed[2], placed[2].clone())  # still readable
""")


def test_the_default_models_codes_are_all_in_one_advised_buffer():
    """A model on its codes (the fp32 split the offline engine and the worker run where the C
    kernel is built) lays every projection's codes and the lm_head's in its load's buffer:
    one storage, advised, each equal to a fresh conversion of the file's weights."""
    run_probe("""
import gc
import gpu.worker_state as worker_state
from fmserve.default_model import default_model_path
from fmserve.engine import Engine
from gpu import cpu_q4_kernel
from gpu.codes_layout import Q4Rows, Q8Rows
from gpu.loader.load import load_model
if cpu_q4_kernel.available():  # else the model keeps no codes of the C kernel
    worker_state.resolve_dtype = lambda setting, device: torch.float32  # the codes' path
    e = Engine(model=str(default_model_path()), device="cpu", dtype="auto",
               max_kv_tokens=512, max_running_requests=2, progress=False)
    rows = [o for o in gc.get_objects() if isinstance(o, (Q4Rows, Q8Rows))]
    codes = [r.nibbles if isinstance(r, Q4Rows) else r.codes for r in rows]
    assert len(codes) > 100
    assert len({c.untyped_storage().data_ptr() for c in codes}) == 1
    assert advised(page_inside(codes[0]))
    loaded = load_model(str(default_model_path()), dtype=torch.float32, progress=False,
                        keep_q4=True)
    fresh = Q4Rows.from_weight(loaded.q4["layers.3.gate_up_proj"][0])
    assert any(c.shape == fresh.nibbles.shape and torch.equal(c, fresh.nibbles) for c in codes)
""")
