"""The service's data-parallel replicas (parallel.dp, service/replica.py) as one: starting and
stopping them, routing a new request to the least-loaded one, finding the one that holds a
request, and the sums that Stats, telemetry and metrics report.

With parallel.dp_attention the replicas are the attention ranks of one worker group
(service/attention_group.py): requests are routed to ranks, while the group is what starts,
steps and stops (`groups`)."""

from __future__ import annotations

import anyio

from ipc.client_messages import ReplicaStatus, WorkerState
from ipc.worker_config import WorkerConfig
from ipc.worker_messages import WorkerInfo
from service.attention_group import AttentionGroup
from service.config import ServiceConfig
from service.counters import ServiceCounters
from service.replica import Replica
from service.replies import Replies
from service.request import RequestOutput
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig
from service.tokenizer import TextTokenizer
from service.worker_supervisor import WorkerHandle

ACCOUNTING_KEYS = ("free_pages", "total_pages", "cached_pages", "prefix_cache_hit_tokens",
                   "free_slots", "total_slots", "waiting", "running")


class ReplicaSet:
    def __init__(self, replicas: list[Replica], groups: list | None = None) -> None:
        """`replicas`: where requests go; `groups`: what has a worker, a `start`, a
        `step_loop` and restarts (each Replica itself, or one AttentionGroup of them all)."""
        self.replicas = replicas
        self.groups = groups if groups is not None else replicas

    @staticmethod
    def build(cfg: ServiceConfig, worker_cfg: WorkerConfig, replies: Replies,
              counters: ServiceCounters) -> "ReplicaSet":
        """The service's replicas from its config: parallel.dp Replicas, or one DP attention
        group of parallel.tp attention ranks."""
        def handle() -> WorkerHandle:
            return WorkerHandle(worker_cfg, ready_timeout_s=cfg.worker.ready_timeout_s,
                                step_timeout_s=cfg.worker.step_timeout_s,
                                standby=cfg.worker.standby)

        if cfg.parallel.dp_attention:
            group = AttentionGroup(handle(), cfg.parallel.tp, replies, counters, cfg.worker)
            return ReplicaSet(list(group.ranks), [group])
        dp = cfg.parallel.dp
        return ReplicaSet([Replica(i, dp, handle(), replies, counters, cfg.worker)
                           for i in range(dp)])

    def __iter__(self):
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)

    async def start(self, tokenizer: TextTokenizer, cfg: SchedulerConfig) -> WorkerInfo:
        """Start every replica's worker at once; if one cannot start, stop them all and raise
        its error (a WorkerStartError, as with one worker: not an exception group)."""
        errors: list[BaseException] = []

        async def start_one(group) -> None:
            try:
                await group.start(tokenizer, cfg)
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                errors.append(exc)

        if len(self.groups) == 1:
            await self.groups[0].start(tokenizer, cfg)
        else:
            async with anyio.create_task_group() as tg:
                for group in self.groups:
                    tg.start_soon(start_one, group)
        if errors:
            await self.stop(timeout_s=2.0)
            raise errors[0]
        # One acceptance record for all: telemetry shows the service's. A result's record and
        # its stop-string correction run in one call, so two replicas never interleave in it.
        for replica in self.replicas[1:]:
            replica.scheduler.core.spec_stats = self.replicas[0].scheduler.core.spec_stats
        return self.replicas[0].info

    async def stop(self, timeout_s: float) -> None:
        async with anyio.create_task_group() as tg:
            for group in self.groups:
                tg.start_soon(lambda g=group: g.worker.stop(timeout_s=timeout_s))

    # -- requests ---------------------------------------------------------------------------

    def route(self) -> Replica | None:
        """Where a new request goes: the least-loaded replica that is not down (None: all are)."""
        up = [r for r in self.replicas if r.state != "down" and r.scheduler is not None]
        return min(up, key=lambda r: r.load(), default=None)

    def holding(self, rid: str) -> Replica | None:
        return next((r for r in self.replicas if r.holds(rid)), None)

    def abort(self, rid: str) -> RequestOutput | None:
        replica = self.holding(rid)
        return None if replica is None else replica.scheduler.abort(rid)

    def fail_all(self, message: str) -> list[RequestOutput]:
        return [out for s in self.schedulers for out in s.fail_all(message)]

    # -- what is reported -------------------------------------------------------------------

    @property
    def schedulers(self) -> list[Scheduler]:
        return [r.scheduler for r in self.replicas if r.scheduler is not None]

    @property
    def info(self) -> WorkerInfo | None:
        """The model's (every replica runs the same): the first replica's last worker's."""
        return next((r.info for r in self.replicas if r.info is not None), None)

    @property
    def max_seq_len(self) -> int:
        return min(s.core.max_seq_len for s in self.schedulers)

    @property
    def state(self) -> WorkerState:
        """"ready" while any replica serves, "down" once all are, else "restarting"."""
        states = {r.state for r in self.replicas}
        return "ready" if "ready" in states else "down" if states == {"down"} else "restarting"

    def accounting(self) -> dict[str, int]:
        accs = [s.accounting() for s in self.schedulers]
        return {k: sum(a[k] for a in accs) for k in ACCOUNTING_KEYS}

    def statuses(self) -> list[ReplicaStatus]:
        return [r.status() for r in self.replicas if r.scheduler is not None]

    @property
    def pid(self) -> int | None:
        return self.groups[0].worker.pid
