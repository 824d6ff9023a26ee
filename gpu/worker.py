"""The worker: a WorkerState and its step class (PlainStep, or EagleStep under speculative
decoding), driven by the worker process's loop (gpu/worker_main.py) and by the offline engine.

    worker = Worker(worker_config(model_path="default"))
    result = worker.finish(worker.launch(plan))

A step runs in two halves: `prepare` (the plan's bookkeeping and batch, on the schedule
stream) and `launch_prepared` (forward, sampling and the FutureMap's writes, on the forward
stream); `finish` waits for the result's host copy and packs it with the step's timings.
On a GPU `launch` returns before the device has run the step; on the CPU it has run.
"""

from __future__ import annotations

import time

import msgspec
import torch

from gpu.eagle.eagle_step import EagleStep
from gpu.heap import release_free_heap, trim_after_prefill
from gpu.plain_step import PlainStep
from gpu.step_streams import ForwardSpan
from gpu.step_types import PendingStep, PreparedStep
from gpu.worker_state import WorkerState
from ipc.worker_config import WorkerConfig
from ipc.worker_messages import DecodeCompile, StepPlan, StepResult, WorkerInfo


class Worker:
    def __init__(self, cfg: WorkerConfig, background_compile: bool = False) -> None:
        """`background_compile`: the worker process's start, ready before its compiled
        decode step is built (gpu/background_compile.py); the offline Engine compiles first."""
        self.state = WorkerState(cfg)
        self.step: PlainStep | EagleStep = (EagleStep(self.state) if cfg.spec.enabled
                                            else PlainStep(self.state, background_compile))
        # What building the step left freed (an EAGLE head's load and first forwards: ~70 MB
        # of the default model's served worker at idle) leaves the resident set.
        release_free_heap()
        # "auto": on a GPU "prepare" (measured on an H100: one stream 328 tok/s against 289
        # for "off", worker idle 6.7% against 18.3%; "on" holds results back, see config.toml);
        # on a CPU launching *is* computing, so finishing first sends the result sooner.
        self.launch_ahead = cfg.launch_ahead if cfg.launch_ahead != "auto" else (
            "prepare" if self.state.device.type == "cuda" else "off")
        self._last_forward_end: float | None = None  # host clock (CPU)
        self._last_span: ForwardSpan | None = None  # device events (GPU)

    @property
    def background_compile_pending(self) -> bool:
        """Built in the background (`background_compile`) and not started yet."""
        compiled = self.step.compiled_decode if isinstance(self.step, PlainStep) else None
        return compiled is not None and compiled.background is not None and \
            not compiled.background.started

    def start_background_compile(self) -> None:
        """Start building the compiled decode step (with `background_compile`). The worker
        process does it once it is ready and idle (gpu/worker_main.py): the build's CPU and
        GIL slow the steps that run meanwhile."""
        if self.background_compile_pending:
            self.step.compiled_decode.background.start()

    def finish_background_compile(self) -> None:
        """Wait for a compiled step's bucket being built on a thread, if one is (an offline
        engine at exit: the build's daemon thread, stopped inside the compiler's C++ as the
        interpreter ends, would abort the process)."""
        compiled = self.step.compiled_decode if isinstance(self.step, PlainStep) else None
        if compiled is not None and compiled.building:
            compiled.background.join()

    def info(self) -> WorkerInfo:
        return msgspec.structs.replace(self.state.info(), decode_compile=self.decode_compile)

    @property
    def decode_compile(self) -> DecodeCompile:
        if not isinstance(self.step, PlainStep):
            return "off"
        if self.step.native_decode is not None:
            return "native"
        compiled = self.step.compiled_decode
        return "off" if compiled is None else compiled.state

    def run_step(self, plan: StepPlan) -> StepResult:
        """Launch and finish one step (no overlap)."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> PendingStep:
        return self.launch_prepared(self.prepare(plan))

    @torch.inference_mode()
    def prepare(self, plan: StepPlan) -> PreparedStep:
        """The first half of `launch`: the plan's bookkeeping and batch (on the schedule
        stream, which first waits for the previous forward's reads). Call it after the
        previous step's `launch_prepared`; the worker process may send that step's result
        between the two halves (launch_ahead "prepare")."""
        start = time.perf_counter()
        step = PreparedStep(plan)
        with self.state.launch_checks(), self.state.streams.scheduling():
            self.state.apply_plan(plan)
            self.step.prepare(step)
        step.prepare_s = time.perf_counter() - start
        return step

    @torch.inference_mode()
    def launch_prepared(self, step: PreparedStep) -> PendingStep:
        """The second half of `launch`: forward, sampling, the FutureMap's writes, and the
        result's host copy (no host sync on a GPU)."""
        start = time.perf_counter()
        pending = PendingStep(step.plan.step_id, decode_compile=self.decode_compile)
        with self.state.launch_checks(), self.state.streams.forwarding() as span:
            pending.span = span
            self.step.launch(step, pending)
        if step.plan.extends and self.state.device.type == "cpu":
            trim_after_prefill()  # in a worker process (gpu/heap.py)
        pending.launch_end = time.perf_counter()
        pending.busy_s = step.prepare_s + pending.launch_end - start
        return pending

    def finish(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step's result and pack it. Steps finish in launch order."""
        host = pending.copy.wait() if pending.copy is not None else None
        forward_ms, idle_ms = self._timings(pending)
        result = self.step.finish(pending, host)
        return msgspec.structs.replace(result, forward_ms=forward_ms, idle_ms=idle_ms,
                                       decode_compile=pending.decode_compile)

    def _timings(self, pending: PendingStep) -> tuple[float, float]:
        """The step's forward time and the device's idle time before it, in ms."""
        if pending.span is not None:  # GPU: the device's own clock
            pending.span.end.synchronize()
            idle_ms = 0.0 if self._last_span is None else float(
                self._last_span.end.elapsed_time(pending.span.start))
            self._last_span = pending.span
            return pending.span.elapsed_ms(), idle_ms
        # CPU: launching is running; idle is the time since the last step's end that this
        # step did not spend preparing or launching (a result sent between the two)
        idle_ms = 0.0 if self._last_forward_end is None else max(0.0, (
            pending.launch_end - self._last_forward_end - pending.busy_s) * 1e3)
        self._last_forward_end = pending.launch_end
        return pending.busy_s * 1e3, idle_ms

    def fast_paths(self) -> str:
        """The fast paths in use, for the worker's ready line in its log."""
        from gpu.llama import unwrap
        from gpu.q4_linear import Q4Linear

        model, cfg = self.state.model, self.state.cfg
        note = (f", {model.q4_projections} projections kept quantized (int4 kernel)"
                if model.q4_projections else "")
        if isinstance(lm_head := unwrap(model.lm_head), Q4Linear):
            note += f", the lm_head up to {lm_head.max_tokens}"
        if cfg.runtime.deterministic:
            note += ", batch-invariant (deterministic: one row at a time)"
        graphs = (self.step.decode_graphs if isinstance(self.step, PlainStep)
                  else getattr(self.step, "graphs", None))
        if graphs is not None:
            what = "decode" if isinstance(self.step, PlainStep) else "EAGLE decode"
            note += f", CUDA graphs for {what} batches up to {graphs.max_batch}"
        elif getattr(self.step, "graphs_error", ""):
            note += f", no CUDA graphs (capturing the EAGLE step failed: {self.step.graphs_error})"
        elif cfg.runtime.cuda_graph_max_batch and self.state.device.type == "cuda":
            note += ", no CUDA graphs (they need the triton attention backend and one rank)"
        headless = getattr(self.step, "headless", None)
        if headless is not None and self.step.gate.drops_heads:  # "auto" on a GPU
            note += (f", batches above {self.step.gate.limit} requests headless as the plain step"
                     + (" (its decode graphs)" if headless.plain.decode_graphs else ""))
        compiled = self.step.compiled_decode if isinstance(self.step, PlainStep) else None
        if isinstance(self.step, PlainStep) and self.step.native_decode is not None:
            from gpu.c_library import kernel_isa
            note += (f", decode batches and chunks up to {self.step.native_decode.max_batch} "
                     f"rows in C ({kernel_isa()} kernels, gpu/cpu_decode_step.py)")
        elif compiled is not None and compiled.background is not None:
            note += (f", decode compiled for batches up to {compiled.max_batch}, batch 1 "
                     f"being built while decode steps run eagerly")
        elif compiled is not None:
            note += (f", decode compiled for batches up to {compiled.max_batch} (batch 1 in "
                     f"{compiled.compile_s.get(1, 0.0):.1f} s)")
        return note
