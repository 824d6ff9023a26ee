"""One data-parallel replica (parallel.dp): a worker group (service/worker_supervisor.py: one
worker process, and its parallel.tp - 1 ranks) with a Scheduler of its own (KV pages, slots,
batch) and its own step loop. With dp = 1 the service has one replica, and that is all.

The Service routes each new request to one replica (service/replica_set.py). A replica whose
worker dies fails its own requests only (service/worker_recovery.py) and restarts under
[worker]'s policy, counted per replica, while the others serve on.
"""

from __future__ import annotations

import time
from collections import deque

import anyio

from ipc.client_messages import ReplicaStatus, WorkerState
from ipc.worker_messages import WorkerInfo
from service.counters import ServiceCounters
from service.replies import Replies
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig
from service.tokenizer import TextTokenizer
from service.worker_recovery import refuse_all, restart_worker
from service.worker_spawn import describe_returncode
from service.worker_supervisor import POLL_INTERVAL_S, WorkerDied, WorkerHandle

# Plans in flight with overlap: step k computing while plan k+1 waits in the worker.
OVERLAP_DEPTH = 2


class Replica:
    def __init__(self, index: int, dp: int, worker: WorkerHandle, replies: Replies,
                 counters: ServiceCounters, policy) -> None:
        """`counters`: the service's (steps and restarts of every replica add up there);
        `policy`: the config's [worker] section."""
        self.index = index
        self.label = f"replica {index}: " if dp > 1 else ""  # log lines, with several
        self.worker = worker
        self.replies, self.counters, self.policy = replies, counters, policy
        self.scheduler: Scheduler | None = None  # made at start; fail_all empties it on restarts
        self.info: WorkerInfo | None = None
        self.state: WorkerState = "restarting"  # until its first worker is ready
        self.restarts = 0
        self.steps = 0
        self.idle_steps = self.idle_forwards = 0  # DP attention's idle batches (attention_group)
        self._work = anyio.Event()

    async def start(self, tokenizer: TextTokenizer, cfg: SchedulerConfig) -> WorkerInfo:
        self.info = await self.worker.start()
        self.state = "ready"
        self.scheduler = Scheduler(self.info, tokenizer, cfg)
        return self.info

    def wake(self) -> None:
        """New work for this replica's step loop."""
        self._work.set()

    @property
    def schedulers(self) -> list[Scheduler]:
        """What a worker death fails (service/worker_recovery.py): this replica's one."""
        return [self.scheduler]

    def holds(self, rid: str) -> bool:
        return self.scheduler is not None and rid in self.scheduler.core.requests

    def load(self) -> tuple:
        """Least first: a serving replica before a restarting one, then the fewest requests
        (running and waiting), then the most free KV pages."""
        acc = self.scheduler.accounting()
        return (self.state != "ready", acc["running"] + acc["waiting"], -acc["free_pages"],
                self.index)

    def status(self) -> ReplicaStatus:
        acc = self.scheduler.accounting()
        return ReplicaStatus(
            index=self.index, worker_state=self.state, pid=self.worker.pid,
            restarts=self.restarts, running=acc["running"], waiting=acc["waiting"],
            free_pages=acc["free_pages"], total_pages=acc["total_pages"],
            free_slots=acc["free_slots"], total_slots=acc["total_slots"], steps=self.steps,
            standby_pid=self.worker.standby_pid, idle_steps=self.idle_steps,
            idle_forwards=self.idle_forwards)

    async def step_loop(self, overlap: bool) -> None:
        """Keep the worker fed. With overlap, plan k+1 is sent before step k's result is read,
        so this process's planning, detokenising and streaming run while the worker computes;
        the worker reads step k's tokens for plan k+1 from its FutureMap."""
        depth = OVERLAP_DEPTH if overlap else 1
        inflight: deque[tuple[object, float, bool]] = deque()  # (plan, sent at, idle counts)
        waited = True  # the worker's idle before a step that follows a wait for work is not ours
        scheduler = self.scheduler
        while True:
            if len(inflight) < depth and scheduler.has_work:
                plan = scheduler.plan_step()
                if plan is not None:
                    try:
                        await self.worker.send_plan(plan)
                    except WorkerDied as exc:
                        inflight.clear()
                        await self._on_worker_death(str(exc))
                        continue
                    inflight.append((plan, time.perf_counter(), not waited))
                    waited = False
                    continue
            if not inflight:
                waited = True
                self._work = anyio.Event()
                # Poll: for work that cannot be planned now (no pages), and for a worker that
                # dies while idle, so that health says so and a replacement loads before a
                # request needs it.
                with anyio.move_on_after(POLL_INTERVAL_S):
                    await self._work.wait()
                code = self.worker.returncode
                if code is not None and self.state == "ready":
                    await self._on_worker_death(f"the worker (pid {self.worker.pid}) exited with "
                                                f"{describe_returncode(code)} while idle")
                continue
            try:
                result = await self.worker.next_result()
            except WorkerDied as exc:
                inflight.clear()
                await self._on_worker_death(str(exc))
                continue
            plan, sent, idle_counts = inflight.popleft()
            outputs = scheduler.process_result(result)  # stop strings end requests here
            self.steps += 1
            self.counters.record_step(plan, result, sent, idle_counts)
            # The next plan goes out before this step's replies: the worker computes while
            # they are metered and sent (at 32 streams on a GPU the replies take about as long
            # as the step; without overlap they were the worker's idle between steps). A
            # worker that died meanwhile is handled after them, so they come before any
            # terminal message its death sends.
            died = await self._send_next_plan(inflight, depth)
            await self.replies.outputs(outputs)
            if died is not None:
                inflight.clear()
                await self._on_worker_death(str(died))
                continue
            await anyio.sleep(0)  # let the receive loop admit new arrivals between steps

    async def _send_next_plan(self, inflight: deque, depth: int) -> WorkerDied | None:
        """Plan and send the next step if there is room (`depth` plans in flight) and work;
        the WorkerDied if sending failed (the plan is then lost with the worker, as at the top
        of step_loop)."""
        if len(inflight) >= depth or not self.scheduler.has_work:
            return None
        plan = self.scheduler.plan_step()
        if plan is None:
            return None
        try:
            await self.worker.send_plan(plan)
        except WorkerDied as exc:
            return exc
        inflight.append((plan, time.perf_counter(), True))
        return None

    async def _on_worker_death(self, message: str) -> None:
        # Meanwhile requests may still be routed here (when every replica is restarting): they
        # wait in its queue and run on the new worker, as a client retrying would want.
        self.state = "restarting"
        info = await restart_worker(self, message)
        if info is not None:
            self.info, self.state = info, "ready"
            return
        self.state = "down"
        await refuse_all(self.scheduler, self.replies)
