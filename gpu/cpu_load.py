"""How many cores other processes kept busy while this one timed something.

A timing taken on a 2-core machine while anything else runs is not this machine's: every
parallel region waits for a descheduled thread. A start-up calibration measured during a test
run once cached "the 4-bit kernel is slower from 2 rows up" (it is 1.6-25x faster at every
size), and every later start ran prefill on the slower path. The 1-minute load average lags
by tens of seconds, so this reads /proc/stat around the timing itself and takes this
process's own CPU time off.
"""

from __future__ import annotations

import os
import time


def _busy_jiffies() -> tuple[int, int] | None:
    """All cores' busy and total jiffies since boot; None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class OtherWork:
    """`with OtherWork() as w: ...`, then `w.cores`: the cores that processes other than this
    one kept busy meanwhile (None where /proc/stat cannot be read)."""

    def __init__(self) -> None:
        self.cores: float | None = None

    def __enter__(self) -> "OtherWork":
        self._jiffies = _busy_jiffies()
        self._own, self._wall = _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        end = _busy_jiffies()
        if self._jiffies is None or end is None:
            return
        busy, total = end[0] - self._jiffies[0], end[1] - self._jiffies[1]
        wall = time.perf_counter() - self._wall
        if total <= 0 or wall <= 0:
            return
        all_busy = (os.cpu_count() or 1) * busy / total
        self.cores = max(0.0, all_busy - (_own_cpu_s() - self._own) / wall)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system
