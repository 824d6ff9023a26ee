"""The streams of one overlapped step on CUDA/HIP: schedule, forward and copy.

    schedule:  waits for the previous forward (its reads of the shared buffers: req_to_token,
               sampling state, the FutureMap), then applies plan k+1's bookkeeping and builds
               its batch (host-to-device copies from pinned memory, never stalling the host)
    forward:   waits for the schedule stream, runs the model, samples, stashes, publishes
    copy:      waits for the forward, copies the step's result into pinned host memory

The host only enqueues work: it blocks in `HostCopy.wait` (the result of step k) and, with an
attention backend that needs host lengths, on the FutureMap's length copy. So while the device
runs step k, the host is already building and launching step k+1.

On the CPU there is one stream and program order: every method runs its body inline and the
timings come from the host clock (see ModelRunner.launch).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class HostCopy:
    """Tensors on their way to the host. `wait()` returns them once they have landed."""

    host: dict[str, torch.Tensor]
    event: object | None = None  # the copy stream's event; None on the CPU
    # The device tensors being read: kept alive until the copy is done, so their memory is not
    # handed to the next forward while the copy stream still reads it.
    sources: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> dict[str, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event, self.sources = None, []
        return self.host


@dataclass
class ForwardSpan:
    """Device-side timing of one forward (CUDA events with timing), read once it is done."""

    start: object
    end: object

    def elapsed_ms(self) -> float:
        return float(self.start.elapsed_time(self.end))


class StepStreams:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"
        self._forward_done = None  # the end event of the last forward launched
        self._scheduled = None  # the schedule stream's event for the step being launched
        if self.enabled:
            self.schedule_stream = torch.cuda.Stream(device)
            self.forward_stream = torch.cuda.Stream(device)
            self.copy_stream = torch.cuda.Stream(device)

    @contextmanager
    def scheduling(self) -> Iterator[None]:
        """Bookkeeping and batch building for the next step."""
        if not self.enabled:
            yield
            return
        if self._forward_done is not None:  # the next plan must not overwrite what it reads
            self.schedule_stream.wait_event(self._forward_done)
        with torch.cuda.stream(self.schedule_stream):
            yield
        self._scheduled = torch.cuda.Event()
        self._scheduled.record(self.schedule_stream)

    @contextmanager
    def forwarding(self) -> Iterator[ForwardSpan | None]:
        """The model forward, sampling, stash and publish. Yields the span being timed."""
        if not self.enabled:
            yield None
            return
        if self._scheduled is not None:
            self.forward_stream.wait_event(self._scheduled)
        span = ForwardSpan(torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
        span.start.record(self.forward_stream)
        with torch.cuda.stream(self.forward_stream):
            yield span
        span.end.record(self.forward_stream)
        self._forward_done = span.end

    def copy_to_host(self, tensors: dict[str, torch.Tensor]) -> HostCopy:
        """Start the device-to-host copy of a step's outputs: after everything enqueued so far
        on the stream that made them (called inside `forwarding`, whose end event is not
        recorded yet)."""
        if not self.enabled:
            return HostCopy(dict(tensors))  # on the host already
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        host = {}
        with torch.cuda.stream(self.copy_stream):
            for name, t in tensors.items():
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                host[name] = buf
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return HostCopy(host, event, list(tensors.values()))

    def synchronize(self) -> None:
        """Wait for everything launched (used before the runner is borrowed for other work)."""
        if self.enabled:
            torch.cuda.synchronize(self.device)
