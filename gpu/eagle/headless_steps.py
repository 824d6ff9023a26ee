"""EAGLE steps whose every request is headless (gpu/eagle/head_lag.py), run as the plain step.

Where the gate finds drafting slower than plain decoding (a CPU), or the batch is above "auto"'s
limit (a GPU), requests run without the head; a step holding only such requests has nothing of
EAGLE's to do. The EAGLE step's own batches, bookkeeping and result packing around the same C
forward still cost ~3% of the worker's time at one stream (py-spy, 2-core AVX512-BF16 EPYC), so
such a step runs through a PlainStep on the same WorkerState instead: the same FutureMap writes
(publish before the forward, stash and record after sampling), the same C step on a CPU, the
same decode CUDA graphs as the plain service on a GPU, its batch built in `prepare`; the same
tokens.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gpu.plain_step import PlainStep
from gpu.step_types import PendingStep, PreparedStep
from ipc.worker_messages import StepResult, unpack_i32


class HeadlessSteps:
    def __init__(self, eagle_step) -> None:
        """`eagle_step`: an EagleStep with a HeadLag, whose C decode step (a CPU's) the plain
        one shares; on a GPU the plain one captures decode graphs of its own."""
        self.eagle = eagle_step
        self.plain = PlainStep(eagle_step.state)
        self.plain.native_decode = eagle_step.native_decode
        self.prepare_s = 0.0  # the last `prepare`'s host seconds (the gate's plain way)

    def applies(self, plan, decode_host: np.ndarray) -> bool:
        """Whether every request of the step (decoding or prefilling) is headless."""
        lag = self.eagle.lag
        slots = [e.slot for e in plan.extends] + decode_host.tolist()
        return bool(slots) and all(s in lag.headless for s in slots)

    def prepare(self, step: PreparedStep) -> None:
        """The plain step's batch (`step.batch`: EagleStep.launch then comes here)."""
        start = time.perf_counter()
        self.plain.prepare(step)
        self.prepare_s = time.perf_counter() - start

    def launch(self, step: PreparedStep, pending: PendingStep, decode_host: np.ndarray) -> None:
        gate = self.eagle.gate
        if len(decode_host):  # a step that could not draft: it counts toward the probe
            gate.drafts(len(decode_host), can_draft=False)
        start = time.perf_counter()
        self.plain.launch(step, pending)
        if len(decode_host) and not step.plan.extends:  # a decode step: the plain way's time
            pending.decode_s = self.prepare_s + time.perf_counter() - start
        pending.headless = True

    def finish(self, pending: PendingStep, host: dict[str, torch.Tensor] | None) -> StepResult:
        result = self.plain.finish(pending, host)
        if pending.decode_s:
            n = len(unpack_i32(result.slots))
            self.eagle.gate.record(n, False, pending.decode_s, n)
            if self.eagle.gate_memory is not None:
                self.eagle.gate_memory.after_step(self.eagle.gate)
        return result
