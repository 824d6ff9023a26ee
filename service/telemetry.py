"""Publishes whole-state `TelemetrySnapshot`s on a ZMQ PUB socket for `fmserve top`.

It reads the service's counters (service/counters.py), the replicas' schedulers and statuses
(one of each with parallel.dp = 1) and the worker's info, handed to it; it never sees the
Service itself."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from ipc.client_messages import ReplicaStatus, WorkerState
from ipc.telemetry import (RequestTelemetry, SpecConfigTelemetry, TelemetrySnapshot,
                           WorkerTelemetry)
from ipc.worker_messages import WorkerInfo
from service.counters import ServiceCounters
from service.request import Request, RequestState
from service.scheduler import Scheduler

THROUGHPUT_WINDOW_S = 5.0


def request_telemetry(req: Request, now: float, text_tail: str | None,
                      replica: int = 0) -> RequestTelemetry:
    # A request whose last prompt chunk is planned counts as decoding for the scheduler;
    # until its first token arrives, people would call it prefilling.
    state = "prefilling" if req.state == RequestState.DECODING and not req.output_ids else \
        req.state.value
    return RequestTelemetry(id=req.rid.split("/", 1)[-1], slot=req.slot or 0, state=state, prompt_len=len(req.prompt_ids),
                            seq_len=req.seq_len, generated=len(req.output_ids),
                            last_accept_len=req.last_accept_len, age_s=now - req.arrival,
                            key=req.rid, accept_length=req.spec_accept_length,
                            text_tail=text_tail, replica=replica)


def spec_config_telemetry(spec) -> SpecConfigTelemetry | None:
    """The config's `[spec]` section for the monitor's header; None while speculation is off."""
    if spec.algorithm == "none":
        return None
    return SpecConfigTelemetry(algorithm=spec.algorithm, num_steps=spec.num_steps,
                               topk=spec.topk, num_draft_tokens=spec.num_draft_tokens,
                               disable_above_batch_size=spec.disable_above_batch_size)


class TelemetryPublisher:
    def __init__(self, ctx: zmq.Context, endpoint: str, counters: ServiceCounters, spec,
                 overlap: bool, *, include_text: bool) -> None:
        """`spec`: the config's [spec] section; `overlap`: scheduling.overlap; `include_text`:
        service.telemetry_include_text (off: every text_tail is None, as whoever can subscribe
        would read every request's output)."""
        self.counters = counters
        self._requested = endpoint
        self.socket = zmq.Socket(ctx, zmq.PUB)  # a plain (blocking-API) socket: sends never wait
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 16)  # a slow monitor drops frames, never blocks us
        self.endpoint: str | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._history: deque[tuple[float, int]] = deque()
        self.overlap = overlap  # the service sets it again once the worker's device is known
        self._speculation = spec.algorithm != "none"
        self._spec_config = spec_config_telemetry(spec)  # fixed for the service's life
        self._include_text = include_text

    def bind(self) -> None:
        self.socket.bind(self._requested)
        self.endpoint = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    def snapshot(self, schedulers: Sequence[Scheduler], info: WorkerInfo,
                 worker_state: WorkerState, replicas: list[ReplicaStatus],
                 draining: bool = False) -> TelemetrySnapshot:
        """`schedulers` and `replicas`: one of each per replica, in replica order."""
        counters = self.counters
        now_m = time.monotonic()
        self._history.append((now_m, counters.output_tokens))
        while self._history and now_m - self._history[0][0] > THROUGHPUT_WINDOW_S:
            self._history.popleft()
        t0, n0 = self._history[0]
        rate = (counters.output_tokens - n0) / (now_m - t0) if now_m > t0 else 0.0
        running, waiting = [], []
        for i, scheduler in enumerate(schedulers):
            tail = scheduler.text.tail if self._include_text else lambda rid: None
            core = scheduler.core
            running += [request_telemetry(r, now_m, tail(r.rid), i)
                        for r in core.running.values()]
            waiting += [request_telemetry(r, now_m, tail(r.rid), i) for r in core.waiting
                        if r.state == RequestState.WAITING]
        cores = [s.core for s in schedulers]
        accs = [c.accounting() for c in cores]
        acc = {k: sum(a[k] for a in accs) for k in accs[0]}
        spec = cores[0].spec_stats  # one for all replicas (service/replica_set.py)
        caches = [c.prefix_cache for c in cores if c.prefix_cache is not None]
        return TelemetrySnapshot(
            time=time.time(), uptime_s=now_m - counters.started, model=info.model_name,
            overlap=self.overlap, speculation=self._speculation,
            running=running, waiting=waiting, free_pages=acc["free_pages"],
            total_pages=acc["total_pages"], page_size=info.page_size,
            free_slots=acc["free_slots"], total_slots=acc["total_slots"],
            output_tokens_per_s=rate, total_output_tokens=counters.output_tokens,
            finished_requests=counters.finished_requests,
            retractions=sum(c.num_retractions for c in cores),
            recent_steps=list(counters.recent_steps)[-16:],
            worker_idle_share=counters.worker_idle_share,
            worker=WorkerTelemetry(alive=worker_state == "ready",
                                   pid=replicas[0].pid if replicas else None,
                                   restarts=counters.worker_restarts, device=info.device,
                                   dtype=info.dtype, attention_backend=info.attention_backend,
                                   state=worker_state,
                                   decode_compile=counters.decode_compile_of(info)),
            spec_accept_length=spec.recent_accept_length, spec_verify_steps=spec.verify_steps,
            spec_accept_rate_per_position=spec.accept_rate_per_position,
            spec_config=self._spec_config,
            prefix_cache_hit_share=sum(c.hit_tokens for c in caches)
            / max(1, sum(c.admitted_tokens for c in caches)) if caches else None,
            cached_pages=acc["cached_pages"], draining=draining, replicas=replicas,
            service_cpu_ms=counters.service_cpu_ms)

    def publish(self, schedulers: Sequence[Scheduler], info: WorkerInfo,
                worker_state: WorkerState, replicas: list[ReplicaStatus],
                draining: bool = False) -> None:
        if self.endpoint is None or not schedulers:
            return
        snapshot = self.snapshot(schedulers, info, worker_state, replicas, draining)
        try:
            self.socket.send(self._encoder.encode(snapshot), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self.socket.close(linger=0)
