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
    """The same window asleep and spinning, in pairs: counted as other work, our own spin would
    add a core to its pair's figure. (Compared pair by pair, each pair's two windows back to
    back and their order alternated, so work elsewhere on the machine weighs on both alike:
    two medians of separate windows once differed by a core as a test on the other core
    started and stopped.)"""
    def window(spin: bool) -> float:
        with OtherWork() as w:
            end = time.perf_counter() + 0.4
            while time.perf_counter() < end:
                if not spin:
                    time.sleep(0.01)
        assert w.cores is not None
        return w.cores

    added = []
    for i in range(5):  # the median of five pairs: a test on the other core moves single ones
        first = window(bool(i % 2))
        second = window(not i % 2)
        added.append(first - second if i % 2 else second - first)  # spinning - asleep
    assert sorted(added)[2] < 0.75, added
