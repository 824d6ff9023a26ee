"""Building the compiled decode step on a thread while the worker already serves eagerly.

A (re)started worker reports ready once the eager path is loaded, and its batch-1 decode step
compiles here, started once the worker is idle (gpu/worker_main.py); decode steps switch to it at a step boundary once it is built
(`CompiledDecode.can_run`, gpu/compiled_decode.py).

The thread shares the GIL with the steps: every torch op of a step releases it and must take
it back from the compile, which holds it for up to the switch interval (5 ms by default; a
trial on 2 shared cores ran the eager steps ~14x slower). While the build runs the interval is
20 us, so a step waits ~20 us an op (one run on the loaded 2-core machine: eager ~1.3x
slower) and the compile runs during the steps' C work; the interval goes back at the end. (Parking the thread
while a step runs, with a profile hook, slowed the compile's Python ~4x: longer eager.)
The compile's one real forward writes the padding page only, which no step reads; dynamo's
tracing state is thread-local or its own; it restores torch's global RNG after a compile, and
sampling draws from its own counter-based random numbers (gpu/seeded_random.py).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Callable

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 20e-6  # while the build runs (see the module docstring)


class BackgroundCompile:
    def __init__(self, build: Callable[[], None], name: str = "fmserve-compile") -> None:
        self._build = build
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._interval = sys.getswitchinterval()
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._thread.ident is not None:
            return  # started already
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def done(self) -> bool:
        return self._thread.ident is not None and not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._build()
        except BaseException as exc:  # the build reports its own failures: this is a bug
            self.error = exc
            log.exception("the background compile failed")
        finally:
            sys.setswitchinterval(self._interval)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait until the build is done or `timeout_s` has passed (tests, benchmarks)."""
        self._thread.join(timeout_s)
        return self.done
