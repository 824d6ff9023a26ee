"""What the service does when its worker dies: every request in flight ends with an error, and
the worker is restarted within `[worker]`'s policy. The same Scheduler serves on: `fail_all`
empties its accounting (pages, slots, prefix cache), matching the fresh worker's empty pool.

A replacement that fails to start (killed while it loads, say) spends one restart, and the next
is tried after a back-off, until `max_restarts` are spent: a transient failure must not take
the service down for good."""

from __future__ import annotations

import logging
import time

import anyio

from ipc.worker_messages import WorkerInfo
from service.counters import ServiceCounters
from service.replies import Replies
from service.scheduler import Scheduler
from service.worker_supervisor import WorkerHandle, WorkerStartError

log = logging.getLogger("fmserve.service")
RESTART_BACKOFF_S = 1.0  # before the second attempt; doubled for each further one
MAX_RESTART_BACKOFF_S = 30.0


async def restart_worker(worker: WorkerHandle, scheduler: Scheduler, replies: Replies,
                         counters: ServiceCounters, policy, message: str) -> WorkerInfo | None:
    """After the worker died with `message`; `policy` is the config's [worker] section.
    Returns the restarted worker's info, or None when it stays down."""
    log.error("worker died: %s", message)
    # Requests that arrive during the restart wait in the queue; only a worker that stays down
    # refuses them (`refuse_all`, once the service no longer admits any).
    for out in scheduler.fail_all(f"the model worker died during a step: {message}"):
        await replies.terminal(out, code="worker_died")
    counters.decode_compile = None  # the replacement's WorkerInfo says it until its first step
    backoff = RESTART_BACKOFF_S
    while policy.restart_on_failure and counters.worker_restarts < policy.max_restarts:
        counters.worker_restarts += 1
        started = time.monotonic()
        try:
            info = await worker.restart()
            log.info("worker restarted in %.1f s", time.monotonic() - started)
            return info
        except WorkerStartError as exc:
            log.error("worker restart %d of %d failed: %s", counters.worker_restarts,
                      policy.max_restarts, exc)
        if counters.worker_restarts < policy.max_restarts:
            log.info("trying again in %g s", backoff)
            await anyio.sleep(backoff)
            backoff = min(2 * backoff, MAX_RESTART_BACKOFF_S)
    log.error("the worker stays down: %d of worker.max_restarts = %d restarts spent%s",
              counters.worker_restarts, policy.max_restarts,
              "" if policy.restart_on_failure else " (worker.restart_on_failure is off)")
    return None


async def refuse_all(scheduler: Scheduler, replies: Replies) -> None:
    """The worker stays down: what came in during the restart ends with an error too."""
    for out in scheduler.fail_all("the model worker is down and could not be restarted"):
        await replies.terminal(out, code="worker_unavailable")
