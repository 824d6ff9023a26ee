"""ipc/process_heap.py's release_library_pages: the pages that a library's start-up alone ran
leave the resident set, only where the file holds them as they are (never a page the process
wrote or relocated), and the library works on afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ipc.process_heap import clean_library_mappings

ROOT = Path(__file__).resolve().parents[2]

SMAPS = """\
7f0000000000-7f0000400000 r-xp 00000000 08:01 11 /venv/torch/lib/libtorch_cpu.so
Rss:                2048 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
7f0000400000-7f0000500000 r--p 00400000 08:01 11 /venv/torch/lib/libtorch_cpu.so
Rss:                 512 kB
Anonymous:           256 kB
Private_Dirty:       256 kB
Shared_Dirty:          0 kB
7f0000500000-7f0000600000 rw-p 00500000 08:01 11 /venv/torch/lib/libtorch_cpu.so
Rss:                 128 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
7f0000600000-7f0000700000 r--p 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6
Rss:                 300 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
7f0000700000-7f0000800000 r--p 00000000 08:01 13 /models/SmolLM2.Q4_1.gguf
Rss:                1024 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
7f0000800000-7f0000900000 r--s 00000000 08:01 14 /venv/lib/libshared.so
Rss:                  64 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
7f0000900000-7f0000a00000 r-xp 00000000 08:01 15 /venv/numpy/_umath.cpython-311-x86_64-linux-gnu.so
Rss:                   0 kB
Anonymous:             0 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
7f0000a00000-7f0000b00000 rw-p 00000000 00:00 0 [heap]
Rss:                 900 kB
Anonymous:           900 kB
Private_Dirty:       900 kB
Shared_Dirty:          0 kB
7f0000b00000-7f0000c00000 r-xp 00000000 08:01 16 /venv/lib/libpartly.so
Rss:                  64 kB
Private_Dirty:         0 kB
Shared_Dirty:          0 kB
"""


def test_only_unwritten_read_only_library_mappings_are_listed():
    listed = clean_library_mappings(SMAPS)
    # libtorch's code and libc's read-only part; not the relocated read-only part (private
    # copies), the writable data, a model file, a shared mapping, a mapping with nothing
    # resident, the heap, or a mapping whose smaps lacks a field (counted as written).
    assert listed == [(0x7F0000000000, 0x7F0000400000, 2048 << 10),
                      (0x7F0000600000, 0x7F0000700000, 300 << 10)]


# In a process of its own: torch imported and used once, its library pages released, then
# used again. Prints the resident bytes of torch's libraries before and after, what was
# released, and whether the results after equal those before.
RELEASE = """
import json, torch
from ipc.process_heap import release_library_pages

def torch_library_rss():
    total, in_torch = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            in_torch = len(head) > 5 and "/torch/lib/" in head[5]
        elif in_torch and head[0] == "Rss:":
            total += int(head[1]) << 10
    return total

def work():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=g)
    return [torch.linalg.solve(a, a @ a).sum().item(), torch.topk(a.flatten(), 5).indices.tolist()]

first = work()
before = torch_library_rss()
released = release_library_pages()
after = torch_library_rss()
print(json.dumps(dict(before=before, released=released, after=after, same=work() == first)))
"""


def test_torch_start_up_pages_leave_the_resident_set_and_torch_works_on():
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps: release_library_pages does nothing here")
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True,
                         check=True, timeout=120, cwd=ROOT)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"], "torch computed differently after its pages were released"
    assert got["released"] > 20 << 20, got  # ~60 MB of op registrations' code
    assert got["before"] - got["after"] > 20 << 20, got
