"""The peak resident memory of a peer's processes while it is measured (`fmserve bench peers`)."""

from __future__ import annotations

import threading


class RssSampler:
    """The peak resident set size of some processes, sampled every `interval` seconds."""

    def __init__(self, pids_fn, interval: float = 0.02) -> None:
        import psutil
        self._psutil, self._pids_fn, self._interval = psutil, pids_fn, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        total = 0
        for pid in self._pids_fn():
            try:
                total += self._psutil.Process(pid).memory_info().rss
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self._interval)

    def __enter__(self) -> RssSampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def tree_pids(pid: int) -> list[int]:
    """A process and its descendants (a service: scheduler + worker)."""
    import psutil
    try:
        proc = psutil.Process(pid)
        return [pid] + [c.pid for c in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
