"""Torch threads on a shared CPU.

With as many torch threads as cores, one busy process elsewhere on the machine makes every
parallel region wait for a descheduled thread: on a 2-core machine a decode step went from
80 ms to 4 s. So long runs re-check now and then how many cores other processes keep busy and
use the rest (at least one, at most what was asked for).

On a GPU the heavy work is not on these threads: the governor then keeps a fixed count
(what was asked, else up to ``GPU_DEFAULT_THREADS``) and never polls /proc, so the host side
(batch assembly, copies, tokenizing) neither starves nor pays for the polling.
"""

from __future__ import annotations

import os
import time

import torch


def _busy_other_processes() -> int:
    """Processes other than this one that are running right now (state R)."""
    me = os.getpid()
    busy = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The state follows the parenthesised command name, which may hold spaces.
        if stat[stat.rfind(b")") + 2:][:1] == b"R":
            busy += 1
    return busy


def other_busy_cores(samples: int = 5, interval: float = 0.05) -> int:
    """How many cores other processes keep busy (the most seen over a few samples)."""
    if not os.path.isdir("/proc"):
        return 0
    seen = 0
    for i in range(samples):
        seen = max(seen, _busy_other_processes())
        if i + 1 < samples:
            time.sleep(interval)
    return seen


GPU_DEFAULT_THREADS = 8  # torch CPU threads beside a GPU when none are asked for


class ThreadGovernor:
    """Keeps torch's thread count at min(asked, free cores); ``asked`` 0 means all cores.

    ``device`` "cuda": a fixed count (``asked``, or all cores up to GPU_DEFAULT_THREADS), not
    adaptive."""

    def __init__(self, asked: int = 0, adaptive: bool = True, device: str = "cpu") -> None:
        self.cores = os.cpu_count() or 1
        self.gpu = str(device).startswith("cuda")
        if self.gpu:
            self.asked = asked if asked > 0 else min(self.cores, GPU_DEFAULT_THREADS)
            adaptive = False
        else:
            self.asked = asked if asked > 0 else self.cores
        self.adaptive = adaptive
        self.current = 0
        self.update()

    def update(self) -> int:
        want = self.asked
        if self.adaptive:
            want = max(1, min(self.asked, self.cores - other_busy_cores()))
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        return want
