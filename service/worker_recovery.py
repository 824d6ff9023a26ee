"""What the service does when its worker dies: every request in flight ends with an error, and
the worker is restarted within `[worker]`'s policy. The same Scheduler serves on: `fail_all`
empties its accounting (pages, slots, prefix cache), matching the fresh worker's empty pool."""

from __future__ import annotations

import logging

from ipc.worker_messages import WorkerInfo
from service.counters import ServiceCounters
from service.replies import Replies
from service.scheduler import Scheduler
from service.worker_supervisor import WorkerHandle, WorkerStartError

log = logging.getLogger("fmserve.service")


async def restart_worker(worker: WorkerHandle, scheduler: Scheduler, replies: Replies,
                         counters: ServiceCounters, policy, message: str) -> WorkerInfo | None:
    """After the worker died with `message`; `policy` is the config's [worker] section.
    Returns the restarted worker's info, or None when it stays down."""
    log.error("worker died: %s", message)
    # Requests that arrive during the restart wait in the queue; only a worker that stays down
    # refuses them (`refuse_all`, once the service no longer admits any).
    for out in scheduler.fail_all(f"the model worker died during a step: {message}"):
        await replies.terminal(out, code="worker_died")
    if not policy.restart_on_failure or counters.worker_restarts >= policy.max_restarts:
        log.error("not restarting the worker (restarts so far: %d)", counters.worker_restarts)
        return None
    try:
        counters.worker_restarts += 1
        return await worker.restart()
    except WorkerStartError as exc:
        log.error("worker restart failed: %s", exc)
        return None


async def refuse_all(scheduler: Scheduler, replies: Replies) -> None:
    """The worker stays down: what came in during the restart ends with an error too."""
    for out in scheduler.fail_all("the model worker is down and could not be restarted"):
        await replies.terminal(out, code="worker_unavailable")
