"""What changed between consecutive telemetry snapshots: events, per-request rates and history.

Snapshots are whole states, not deltas, so everything the monitor shows over time is derived
here by comparing each snapshot with the one before: requests that left the batch, requests
sent back to the queue (preemption), the `retractions` counter rising, worker restarts and the
worker going down. Per-request tokens/s is the change in `generated` over a short window of
snapshot times, so it does not depend on how often the screen redraws.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ipc.telemetry import RequestTelemetry, TelemetrySnapshot

INFO, WARNING, ERROR = "info", "warning", "error"


def request_key(r: RequestTelemetry) -> str:
    """The service-wide id of a request: `key`, else the client id. Client ids are only unique
    per connection; the service's own id is `"<client-hex>/<client id>"`, and that is what an
    admin abort must name."""
    return r.key or r.id


def service_restarted(prev: TelemetrySnapshot, snap: TelemetrySnapshot) -> bool:
    """A new run of the service: its uptime went back (a run that had finished nothing yet
    still has every counter at 0), or a counter did."""
    return snap.uptime_s < prev.uptime_s or snap.finished_requests < prev.finished_requests or \
        snap.total_output_tokens < prev.total_output_tokens


@dataclass(frozen=True)
class MonitorEvent:
    time: float  # unix seconds (the snapshot's clock, or the monitor's for its own events)
    level: str  # INFO | WARNING | ERROR
    text: str


@dataclass(frozen=True)
class RequestSample:
    time: float  # snapshot time
    state: str
    slot: int
    seq_len: int
    generated: int
    last_accept_len: int
    tokens_per_s: float | None
    accept_length: float | None = None  # mean tokens per verify step, when published


@dataclass
class RequestTrack:
    """One request as the monitor has seen it, kept a while after it leaves for the detail view."""

    key: str
    id: str
    prompt_len: int
    first_seen: float
    samples: deque[RequestSample]
    ended_at: float | None = None
    end_note: str | None = None
    abort_requested: bool = False
    text: str | None = None  # the newest tail of its output text; None: the service sends none

    @property
    def last(self) -> RequestSample:
        return self.samples[-1]


@dataclass
class SnapshotTracker:
    """Feed it every snapshot the screen shows, in order; it returns the events each one caused."""

    history: int = 600  # samples kept per request (2.5 min at 4 snapshots/s)
    rate_window_s: float = 2.0
    keep_ended: int = 64  # requests that left, kept for the detail view
    series_len: int = 120  # points of the throughput / accept-length sparklines
    previous: TelemetrySnapshot | None = None
    tracks: dict[str, RequestTrack] = field(default_factory=dict)
    ended: deque[str] = field(default_factory=deque)
    throughput: deque[float] = field(default_factory=deque)
    accept_len: deque[float] = field(default_factory=deque)
    steps_per_s: float | None = None  # from step ids between the last two snapshots
    worker_busy: float | None = None  # share of that time the worker spent in forwards
    service_ms_per_step: float | None = None  # the service's CPU time a step, over that time

    def mark_abort_requested(self, key: str) -> None:
        if key in self.tracks:
            self.tracks[key].abort_requested = True

    def rate(self, key: str) -> float | None:
        track = self.tracks.get(key)
        return None if track is None else track.last.tokens_per_s

    def update(self, snap: TelemetrySnapshot) -> list[MonitorEvent]:
        prev, self.previous = self.previous, snap
        self._push_series(snap)
        current = {request_key(r): r for r in [*snap.running, *snap.waiting]}
        for key, r in current.items():
            self._sample(key, r, snap.time)
        if prev is None:
            return []
        restarted = service_restarted(prev, snap)
        if restarted:  # step ids start again at 1: no rate across the two runs
            self.steps_per_s = self.worker_busy = self.service_ms_per_step = None
        else:
            self._step_rates(prev, snap)
        return self._diff(prev, snap, current, restarted)

    # ----- internals ---------------------------------------------------------------------

    def _push_series(self, snap: TelemetrySnapshot) -> None:
        self.throughput.append(snap.output_tokens_per_s)
        if snap.speculation:
            mean = snap.spec_accept_length  # the service's recent window
            if mean is None:  # no verify steps in it yet: this snapshot's batch
                decoding = [r.last_accept_len + 1 for r in snap.running if r.state == "decoding"]
                mean = sum(decoding) / len(decoding) if decoding else None
            if mean is not None:
                self.accept_len.append(mean)
        for series in (self.throughput, self.accept_len):
            while len(series) > self.series_len:
                series.popleft()

    def _step_rates(self, prev: TelemetrySnapshot, snap: TelemetrySnapshot) -> None:
        dt = snap.time - prev.time
        if dt <= 0 or not snap.recent_steps:
            return
        last_prev = prev.recent_steps[-1].step_id if prev.recent_steps else -1
        new = [s for s in snap.recent_steps if s.step_id > last_prev]
        n = snap.recent_steps[-1].step_id - last_prev if prev.recent_steps else len(new)
        self.steps_per_s = n / dt
        # recent_steps holds the last few steps only: scale their mean to all n of them.
        mean_fwd_s = sum(s.forward_ms for s in new) / len(new) / 1000.0 if new else 0.0
        self.worker_busy = min(1.0, n * mean_fwd_s / dt)
        known = snap.service_cpu_ms is not None and prev.service_cpu_ms is not None
        per_step = (snap.service_cpu_ms - prev.service_cpu_ms) / n if known and n > 0 else None
        # None where not reported, no step ran, or a foreign publisher sent NaN or infinity
        finite = per_step is not None and math.isfinite(per_step)
        self.service_ms_per_step = per_step if finite else None

    def _sample(self, key: str, r: RequestTelemetry, now: float) -> None:
        track = self.tracks.get(key)
        if track is None or track.ended_at is not None:  # new, or an id reused after it ended
            track = RequestTrack(key, r.id, r.prompt_len, now, deque(maxlen=self.history))
            self.tracks[key] = track
        rate = None
        # The oldest sample inside the window (or the newest before it) is the rate's base.
        base = None
        for s in reversed(track.samples):
            base = s
            if now - s.time >= self.rate_window_s:
                break
        if base is not None and now > base.time:
            rate = (r.generated - base.generated) / (now - base.time)
        track.samples.append(RequestSample(now, r.state, r.slot, r.seq_len, r.generated,
                                           r.last_accept_len, rate,
                                           r.accept_length))
        track.text = r.text_tail  # only the newest: it holds the older text

    def _end(self, key: str, when: float, note: str) -> None:
        track = self.tracks[key]
        track.ended_at, track.end_note = when, note
        self.ended.append(key)
        while len(self.ended) > self.keep_ended:
            old = self.ended.popleft()
            if old in self.tracks and self.tracks[old].ended_at is not None:
                del self.tracks[old]

    def _diff(self, prev: TelemetrySnapshot, snap: TelemetrySnapshot,
              current: dict[str, RequestTelemetry],
              service_restarted: bool) -> list[MonitorEvent]:
        t = snap.time
        events: list[MonitorEvent] = []
        pw, cw = prev.worker, snap.worker
        restarted = cw.restarts > pw.restarts
        if service_restarted:
            events.append(MonitorEvent(t, WARNING, "the service restarted (its uptime and "
                                       "counters started again)"))
        if restarted:
            events.append(MonitorEvent(
                t, ERROR, f"worker restarted (restart #{cw.restarts}, pid {pw.pid} -> {cw.pid}); "
                          f"the requests it was running failed"))
        if cw.state == "down" and pw.state != "down":
            events.append(MonitorEvent(t, ERROR, "worker down and not restarted: the service "
                                                 "refuses new requests; see its log"))
        elif cw.alive and not pw.alive:
            events.append(MonitorEvent(t, INFO, f"worker up again (pid {cw.pid})"))
        if snap.retractions > prev.retractions:
            n = snap.retractions - prev.retractions
            events.append(MonitorEvent(
                t, WARNING, f"{n} request(s) retracted to the queue to free KV pages "
                            f"(preemption; {snap.retractions} so far)"))
        prev_running = {request_key(r): r for r in prev.running}
        for key, r in current.items():
            if r.state == "waiting" and key in prev_running:
                old = prev_running[key]
                events.append(MonitorEvent(t, WARNING, f"request {old.id} preempted at "
                                                       f"seq_len {old.seq_len}, back in the queue"))
        ended: list[str] = []
        for r in [*prev.running, *prev.waiting]:
            key = request_key(r)
            if key in current or key not in self.tracks:
                continue
            track = self.tracks[key]
            if service_restarted:
                note, level = "lost: the service restarted", WARNING
            elif track.abort_requested:
                note, level = "aborted from top", WARNING
            elif restarted or not cw.alive:
                note, level = "failed: the worker died", ERROR
            elif r.state == "waiting":
                note, level = "left the queue before running (aborted or failed)", WARNING
            else:
                note = f"ended (last seen at {r.generated} tokens, seq_len {r.seq_len})"
                level = INFO
            self._end(key, t, note)
            if level == INFO:
                ended.append(f"{r.id} (>= {r.generated} tok)")
            else:
                events.append(MonitorEvent(t, level, f"request {r.id} {note}"))
        if ended:  # one line for the ordinary case, so a busy service does not flood the log
            events.append(MonitorEvent(t, INFO, f"{len(ended)} request(s) ended: "
                                                + ", ".join(ended)))
        return events
