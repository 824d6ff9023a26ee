"""What the service counts over its life, in one place: `Stats` replies (`stats`) and the
telemetry snapshots read the same numbers. With data-parallel replicas, their steps and
restarts add up here."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ipc.client_messages import ReplicaStatus, Stats, WorkerState
from ipc.telemetry import StepTelemetry
from ipc.worker_messages import DecodeCompile, StepPlan, StepResult, WorkerInfo, unpack_i32

RECENT_STEPS = 64


@dataclass
class ServiceCounters:
    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    output_tokens: int = 0  # tokens sent to clients
    finished_requests: int = 0  # answered with their terminal message, errors included
    finished_by_reason: dict[str, int] = field(default_factory=dict)  # stop/length/abort/error
    prompt_tokens: int = 0  # prompts of requests that ended (Prometheus' prompt_tokens_total)
    # Sums over steps: the worker's idle share = idle / (idle + busy). Idle counts only for
    # steps that followed queued work (waiting for clients is not the worker's idle).
    worker_busy_ms: float = 0.0
    worker_idle_ms: float = 0.0
    worker_restarts: int = 0
    clients_cut_off: int = 0  # over service.max_queued_replies unread (service/replies.py)
    # The worker's compiled decode step as of its last step; None: no step since it started
    # (then its WorkerInfo says it)
    decode_compile: DecodeCompile | None = None
    recent_steps: deque[StepTelemetry] = field(
        default_factory=lambda: deque(maxlen=RECENT_STEPS))

    def record_step(self, plan: StepPlan, result: StepResult, sent: float,
                    idle_counts: bool) -> None:
        """A step's result came back; `sent` is the perf_counter() reading when its plan went."""
        decodes = len(unpack_i32(plan.decode_slots))
        num_tokens = sum(len(unpack_i32(e.token_ids)) for e in plan.extends) + decodes
        self.steps += 1
        self.worker_busy_ms += result.forward_ms
        self.worker_idle_ms += result.idle_ms if idle_counts else 0.0
        # Numbered by the service, not by the plan: replicas number their plans each from 1.
        self.decode_compile = result.decode_compile
        self.recent_steps.append(StepTelemetry(
            self.steps, len(plan.extends) + decodes, num_tokens, result.forward_ms,
            (time.perf_counter() - sent) * 1000.0, result.idle_ms))

    def stats(self, acc: dict[str, int], info: WorkerInfo, worker_state: WorkerState,
              instance: str, waiting_extra: int, draining: bool,
              replicas: list[ReplicaStatus]) -> Stats:
        """A Stats reply: these counters and the replicas' accounting summed (`acc`); requests
        still being tokenized (`waiting_extra`) count as waiting."""
        return Stats(model=info.model_name, device=info.device,
                     worker_alive=worker_state == "ready", worker_state=worker_state,
                     worker_restarts=self.worker_restarts,
                     running=acc["running"], waiting=acc["waiting"] + waiting_extra,
                     free_pages=acc["free_pages"], total_pages=acc["total_pages"],
                     free_slots=acc["free_slots"], total_slots=acc["total_slots"],
                     steps=self.steps, output_tokens=self.output_tokens,
                     worker_busy_ms=self.worker_busy_ms, worker_idle_ms=self.worker_idle_ms,
                     cached_pages=acc["cached_pages"],
                     prefix_cache_hit_tokens=acc["prefix_cache_hit_tokens"],
                     instance=instance, draining=draining, replicas=replicas,
                     decode_compile=self.decode_compile_of(info),
                     service_cpu_ms=self.service_cpu_ms)

    def decode_compile_of(self, info: WorkerInfo) -> DecodeCompile:
        return self.decode_compile or info.decode_compile

    @property
    def service_cpu_ms(self) -> float:
        """This process's CPU time since it started, all its threads (scheduling, replies,
        ZMQ's I/O threads, HTTP): Stats and telemetry report it, readers take its growth."""
        return time.process_time() * 1000.0

    @property
    def worker_idle_share(self) -> float:
        return self.worker_idle_ms / max(self.worker_idle_ms + self.worker_busy_ms, 1e-9)
