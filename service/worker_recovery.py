"""What a replica does when its worker dies: every request in flight on it ends with an error,
and the worker is restarted within `[worker]`'s policy (each data-parallel replica on its own;
the others serve on). The same Scheduler serves on: `fail_all` empties its accounting (pages,
slots, prefix cache), matching the fresh worker's empty pool.

A replacement that fails to start (killed while it loads, say) spends one restart, and the next
is tried after a back-off, until `max_restarts` are spent: a transient failure must not take
the service down for good."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import anyio

from ipc.worker_messages import WorkerInfo
from service.counters import ServiceCounters
from service.replies import Replies
from service.scheduler import Scheduler
from service.worker_supervisor import WorkerHandle, WorkerStartError

log = logging.getLogger("fmserve.service")
RESTART_BACKOFF_S = 1.0  # before the second attempt; doubled for each further one
MAX_RESTART_BACKOFF_S = 30.0


class Restartable(Protocol):
    """A replica (service/replica.py) or a DP attention group (service/attention_group.py), as
    far as restarting its worker goes."""

    label: str  # "" with one replica, "replica 1: " with several
    worker: WorkerHandle
    schedulers: list[Scheduler]  # every request of theirs fails when the worker dies
    replies: Replies
    counters: ServiceCounters  # the service's: worker_restarts sums every replica's
    policy: object  # the config's [worker] section
    restarts: int  # this replica's, which max_restarts bounds


async def restart_worker(replica: Restartable, message: str) -> WorkerInfo | None:
    """After the replica's worker died with `message`. Returns the restarted worker's info,
    or None when it stays down."""
    name, policy = replica.label, replica.policy
    log.error("%sworker died: %s", name, message)
    # Requests that arrive during the restart wait in the queue; only a worker that stays down
    # refuses them (`refuse_all`, once the service no longer admits any).
    for scheduler in replica.schedulers:
        for out in scheduler.fail_all(f"the model worker died during a step: {message}"):
            await replica.replies.terminal(out, code="worker_died")
    # The replacement's WorkerInfo says it until its first step.
    replica.counters.decode_compile = None
    backoff = RESTART_BACKOFF_S
    while policy.restart_on_failure and replica.restarts < policy.max_restarts:
        replica.restarts += 1
        replica.counters.worker_restarts += 1
        started = time.monotonic()
        try:
            info = await replica.worker.restart()
            log.info("%sworker restarted in %.1f s", name, time.monotonic() - started)
            return info
        except WorkerStartError as exc:
            log.error("%sworker restart %d of %d failed: %s", name, replica.restarts,
                      policy.max_restarts, exc)
        if replica.restarts < policy.max_restarts:
            log.info("%strying again in %g s", name, backoff)
            await anyio.sleep(backoff)
            backoff = min(2 * backoff, MAX_RESTART_BACKOFF_S)
    log.error("%sthe worker stays down: %d of worker.max_restarts = %d restarts spent%s", name,
              replica.restarts, policy.max_restarts,
              "" if policy.restart_on_failure else " (worker.restart_on_failure is off)")
    return None


async def refuse_all(scheduler: Scheduler, replies: Replies) -> None:
    """The worker stays down: what came in during the restart ends with an error too."""
    for out in scheduler.fail_all("the model worker is down and could not be restarted"):
        await replies.terminal(out, code="worker_unavailable")
