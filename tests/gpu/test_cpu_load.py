"""The cores other processes keep busy while this one times something (gpu/cpu_load.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from gpu.cpu_load import OtherWork

SPIN = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


def spinners(n: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)]) for _ in range(n)]


def test_processes_spinning_meanwhile_count_as_other_work():
    procs = spinners(2, 2.0)
    time.sleep(0.3)  # past their start-up
    with OtherWork() as other:
        time.sleep(1.0)
    for p in procs:
        p.wait()
    # Two spinning processes on however many cores: at least most of one core is theirs.
    assert other.cores is not None and other.cores >= 0.7, other.cores


def test_this_process_own_work_is_not_other_work():
    with OtherWork() as alone:
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
    procs = spinners(2, 1.5)
    time.sleep(0.3)
    with OtherWork() as beside:
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
    for p in procs:
        p.wait()
    # The same spin of ours, with and without two others spinning: only theirs is counted.
    assert alone.cores is not None and beside.cores is not None
    assert beside.cores >= alone.cores + 0.5, (alone.cores, beside.cores)
