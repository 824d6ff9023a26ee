"""DP attention through the service (parallel.dp_attention with parallel.tp = N; the worker
side is gpu/dp_attention.py and gpu/group_step.py): N attention ranks, each with a Scheduler of
its own (KV pages, slots, prefix cache, batch), behind ONE worker group (one WorkerHandle:
rank 0 the service's worker process, ranks 1..N-1 its children) stepping in lockstep.

Each attention rank is an `AttentionRank`, a Replica to the rest of the service: the
ReplicaSet routes a new request to the least-loaded one, Stats and telemetry carry one
ReplicaStatus each (with the idle batches it ran). The group's one step loop plans every
rank's step, sends them together as one GroupPlan (an empty plan where a rank has nothing to
run: it runs an idle batch, as the ranks' MLP collectives need every rank in every forward),
and hands each rank's result to its scheduler. Overlap stays off: one group step in flight.

A worker death (any rank's) fails every request of every rank once and restarts the group
under [worker]'s policy, as a tensor-parallel group restarts.
"""

from __future__ import annotations

import time

import anyio

from ipc.worker_messages import GroupPlan, GroupResult, StepPlan, WorkerInfo, pack_i32
from service.counters import ServiceCounters
from service.replica import Replica
from service.replies import Replies
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig
from service.tokenizer import TextTokenizer
from service.worker_recovery import refuse_all, restart_worker
from service.worker_spawn import describe_returncode
from service.worker_supervisor import POLL_INTERVAL_S, WorkerDied, WorkerHandle


class AttentionRank(Replica):
    """One attention rank's scheduler and counts; its steps are its group's."""

    def __init__(self, index: int, group: AttentionGroup) -> None:
        super().__init__(index, group.size, group.worker, group.replies, group.counters,
                         group.policy)
        self.group = group
        self.label = f"attention rank {index}: "

    def wake(self) -> None:
        self.group.wake()

    async def start(self, tokenizer: TextTokenizer, cfg: SchedulerConfig) -> WorkerInfo:
        raise RuntimeError("an attention rank starts with its group (AttentionGroup.start)")

    async def step_loop(self, overlap: bool) -> None:
        raise RuntimeError("an attention rank steps with its group (AttentionGroup.step_loop)")


class AttentionGroup:
    def __init__(self, worker: WorkerHandle, size: int, replies: Replies,
                 counters: ServiceCounters, policy) -> None:
        """`size`: parallel.tp, the attention ranks; `counters`: the service's; `policy`: the
        config's [worker] section."""
        self.worker, self.size = worker, size
        self.replies, self.counters, self.policy = replies, counters, policy
        self.label = ""  # log lines (service/worker_recovery.py)
        self.restarts = 0
        self.step_id = 0
        self.ranks = [AttentionRank(i, self) for i in range(size)]
        self._work = anyio.Event()

    @property
    def schedulers(self) -> list[Scheduler]:
        return [r.scheduler for r in self.ranks]

    def wake(self) -> None:
        self._work.set()

    async def start(self, tokenizer: TextTokenizer, cfg: SchedulerConfig) -> WorkerInfo:
        info = await self.worker.start()
        for rank in self.ranks:  # every rank's pool is the size the worker reports
            rank.info, rank.state = info, "ready"
            rank.scheduler = Scheduler(info, tokenizer, cfg)
        return info

    async def step_loop(self, overlap: bool) -> None:
        """Keep the group stepping while any rank has work. `overlap` is not used: the worker
        answers a GroupPlan before it reads the next (gpu/group_step.py)."""
        del overlap
        waited = True  # the worker's idle before a step that follows a wait is not ours
        while True:
            plans = [r.scheduler.plan_step() if r.scheduler.has_work else None
                     for r in self.ranks]
            if all(p is None for p in plans):
                waited = True
                self._work = anyio.Event()
                # Poll: for work that cannot be planned now (no pages), and for a worker that
                # dies while idle (health says so; the replacement loads before it is needed).
                with anyio.move_on_after(POLL_INTERVAL_S):
                    await self._work.wait()
                code = self.worker.returncode
                if code is not None and self.ranks[0].state == "ready":
                    await self._on_worker_death(f"the worker (pid {self.worker.pid}) exited with "
                                                f"{describe_returncode(code)} while idle")
                continue
            self.step_id += 1
            group = GroupPlan(self.step_id, [p or idle_plan(self.step_id) for p in plans])
            sent = time.perf_counter()
            try:
                await self.worker.send_plan(group)
                result = await self.worker.next_result()
            except WorkerDied as exc:
                await self._on_worker_death(str(exc))
                continue
            await self._process(plans, result, sent, not waited)
            waited = False
            await anyio.sleep(0)  # let the receive loop admit new arrivals between steps

    async def _process(self, plans: list[StepPlan | None], result: GroupResult, sent: float,
                       idle_counts: bool) -> None:
        for rank, plan, part in zip(self.ranks, plans, result.results):
            rank.idle_steps += part.idle_steps
            rank.idle_forwards += part.idle_forwards
            if plan is None:
                continue  # an idle batch: nothing of this rank's scheduler was in it
            await self.replies.outputs(rank.scheduler.process_result(part.result))
            rank.steps += 1
        # One worker step for the service's counters: every rank's rows, rank 0's timings
        # (the ranks step in lockstep).
        self.counters.record_step(merged_plan(self.step_id, plans), result.results[0].result,
                                  sent, idle_counts)

    async def _on_worker_death(self, message: str) -> None:
        # Requests routed here meanwhile wait in the ranks' queues and run on the new group.
        for rank in self.ranks:
            rank.state = "restarting"
        info = await restart_worker(self, message)
        for rank in self.ranks:
            rank.restarts = self.restarts
            rank.info, rank.state = (info, "ready") if info is not None else (rank.info, "down")
        if info is None:
            for rank in self.ranks:
                await refuse_all(rank.scheduler, self.replies)


def idle_plan(step_id: int) -> StepPlan:
    """A rank's part of a group step where it has nothing to run: its idle batch."""
    return StepPlan(step_id, [], [], [], pack_i32([]), pack_i32([]))


def merged_plan(step_id: int, plans: list[StepPlan | None]) -> StepPlan:
    """The ranks' plans as one, for the service's step counters (rows and tokens)."""
    busy = [p for p in plans if p is not None]
    decodes = b"".join(p.decode_slots for p in busy)
    return StepPlan(step_id, [], [], [e for p in busy for e in p.extends], decodes, b"")
