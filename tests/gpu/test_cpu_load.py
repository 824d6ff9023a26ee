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
    """The same window asleep and spinning, in turns: counted as other work, our own spin would
    add a core. (Compared in turns, so work elsewhere on the machine weighs on both alike.)"""
    def window(spin: bool) -> float:
        with OtherWork() as w:
            end = time.perf_counter() + 0.4
            while time.perf_counter() < end:
                if not spin:
                    time.sleep(0.01)
        assert w.cores is not None
        return w.cores

    asleep, spinning = [], []
    for _ in range(5):  # medians of five: a test beside it on the other core moves single ones
        asleep.append(window(False))
        spinning.append(window(True))
    assert sorted(spinning)[2] < sorted(asleep)[2] + 0.75, (asleep, spinning)
