"""The worker's step executor: applies a StepPlan to the device state and runs one forward.

It owns everything device-side: weights, the KV pool, `req_to_token`, per-slot sampling state and
the per-slot relay buffers (`output_tokens_buf`: the last token each slot produced;
`seq_lens_buf`: each slot's length in the cache). Decode entries therefore need only slots.
The same class serves the offline engine (called in-process) and the worker process (over ZMQ).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

from gpu.attention.base import AttentionBackend
from gpu.decode_graphs import DecodeGraphs
from gpu.device import device_kind, host_to_device, resolve_device, resolve_dtype
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.future_map import FutureMap
from gpu.kv_cache import KVPool, ReqToTokenPool
from gpu.llama import LlamaModel
from gpu.loader.load import load_model
from gpu.plan_check import check_plan
from gpu.q4_linear import DEFAULT_Q4_MAX_TOKENS, q4_applies
from gpu.sampler import Sampler, SamplingState
from gpu.step_streams import ForwardSpan, HostCopy, StepStreams
from gpu.sync_guard import no_host_sync, sync_check_from_env
from ipc.spec_settings import SpecSettings
from ipc.worker_messages import (WORKER_PROTOCOL_VERSION, StepPlan, StepResult, WorkerInfo,
                                 pack_f32, pack_i32, unpack_i32)

ATTENTION_BACKENDS = ("torch", "triton")
# The worker's order when plan k+1 is already waiting while step k is launched but not sent:
#   off:     finish and send step k, then prepare and launch k+1
#   prepare: prepare k+1 (bookkeeping and batch, on the schedule stream), send k, launch k+1:
#            the device's gap between the forwards holds only the sending of result k
#   on:      prepare and launch k+1, then send k (the device never waits, but a host-bound
#            launch holds result k back by a whole step)
LAUNCH_AHEAD_MODES = ("off", "prepare", "on", "auto")


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "torch"
    page_size: int = 16
    max_kv_tokens: int = 65536
    max_running_requests: int = 64
    max_context_len: int | None = None  # None: the model's own
    progress: bool = True
    wrwr_check: bool | None = None  # None: from FMSERVE_WRWR_CHECK
    # Launch under gpu/sync_guard.py's no_host_sync (debug). None: from FMSERVE_SYNC_CHECK.
    sync_check: bool | None = None
    cpu_threads: int = 0  # torch threads when running on the CPU; 0 = torch's default
    weight_quant: str = "none"  # "none", "int8" or "fp16": see gpu/quantized_linear.py
    # Forwards of at most this many tokens multiply with a GGUF's own Q4_0/Q4_1 codes (CPU,
    # bf16 only; gpu/q4_linear.py); 0: always the dequantized weights.
    q4_max_tokens: int = DEFAULT_Q4_MAX_TOKENS
    spec: SpecSettings = SpecSettings()  # speculative decoding (EAGLE); off by default
    # What the worker does with plan k+1 when it is already waiting before step k's result is
    # sent (see LAUNCH_AHEAD_MODES). "auto": "on" on GPUs (launching is asynchronous there),
    # "off" on a CPU (there launching *is* computing, so finishing first sends the result
    # sooner). Tests force the other modes on the CPU to run those orders too.
    launch_ahead: str = "auto"
    # Decode batches of up to this many requests replay a captured CUDA graph of the decoder
    # (gpu/decode_graphs.py); 0: never. CUDA only, with an attention backend that reads no host
    # lengths (triton); ignored on the CPU and under speculative decoding.
    cuda_graph_max_batch: int = 0


@dataclass
class PreparedStep:
    """A plan applied and its batch built (ModelRunner.prepare), its forward not launched yet."""

    plan: StepPlan
    prepare_s: float = 0.0  # host time spent preparing
    batch: ForwardBatch | None = None  # None: an EAGLE step, which builds its batches in launch
    sample_rows: torch.Tensor | None = None
    sample_slots_host: np.ndarray | None = None  # the sampled slots, for a sync-free sampler


@dataclass
class PendingStep:
    """A launched step whose result is still on its way (see ModelRunner.launch/finish)."""

    step_id: int
    launch_end: float  # host clock when launching returned
    busy_s: float = 0.0  # host time preparing and launching (on the CPU: computing)
    copy: HostCopy | None = None  # None: nothing to copy (an idle plain step)
    span: ForwardSpan | None = None  # device timing (GPU)
    eagle_parts: list | None = None  # an EAGLE step: what EagleWorker.finish packs
    n_top: int = 0


def make_attention_backend(name: str, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                           num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    scale = head_dim ** -0.5
    if name == "torch":
        from gpu.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, scale)
    if name == "triton":
        from gpu.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(f"attention backend '{name}' is unknown; choose one of {ATTENTION_BACKENDS}")


class ModelRunner:
    def __init__(self, cfg: RunnerConfig) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if self.device.type == "cpu" and cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)
        if cfg.q4_max_tokens < 0:
            raise ValueError(f"q4_max_tokens is {cfg.q4_max_tokens}: it must be 0 (never use the "
                             f"file's 4-bit weights) or a positive number of tokens")
        keep_q4 = cfg.weight_quant == "none" and q4_applies(self.device, self.dtype,
                                                             cfg.q4_max_tokens)
        loaded = load_model(cfg.model_path, dtype=self.dtype, progress=cfg.progress,
                            keep_q4=keep_q4)
        self.model_config = mc = loaded.config
        self.model_name = Path(cfg.model_path).name
        self.model = LlamaModel(mc, loaded.weights, self.device, self.dtype,
                                weight_quant=cfg.weight_quant, q4=loaded.q4,
                                q4_max_tokens=cfg.q4_max_tokens, lm_head_q4=loaded.lm_head_q4)
        del loaded
        self.max_context_len = min(cfg.max_context_len or mc.max_context_len, mc.max_context_len)
        self.num_slots = cfg.max_running_requests + 1  # slot 0 is padding
        num_pages = -(-cfg.max_kv_tokens // cfg.page_size) + 1  # page 0 is padding
        self.kv_pool = KVPool(mc.num_layers, num_pages, cfg.page_size, mc.num_kv_heads,
                              mc.head_dim, self.dtype, self.device)
        # Under speculation a request near the context limit still drafts and verifies a few
        # positions past it (the scheduler discards those tokens): its row has room for them.
        self.req_to_token = ReqToTokenPool(self.num_slots,
                                           self.max_context_len + cfg.spec.reserve_tokens,
                                           cfg.page_size, self.device)
        self.attn = make_attention_backend(cfg.attention_backend, self.kv_pool, self.req_to_token,
                                           mc.num_heads, mc.num_kv_heads, mc.head_dim)
        self.needs_cpu_seq_lens = self.attn.needs_cpu_seq_lens
        self.sampling_state = SamplingState(self.num_slots, mc.vocab_size, self.device,
                                            eos_token_ids=mc.eos_token_ids)
        self.sampler = Sampler(self.sampling_state)
        # Per-slot relay buffers (see module docstring).
        self.future_map = FutureMap(self.num_slots, self.device, cfg.wrwr_check)
        self.sync_check = sync_check_from_env() if cfg.sync_check is None else cfg.sync_check
        self.streams = StepStreams(self.device)
        if cfg.launch_ahead not in LAUNCH_AHEAD_MODES:
            raise ValueError(f"launch_ahead '{cfg.launch_ahead}' is unknown; choose one of "
                             f"{LAUNCH_AHEAD_MODES}")
        self.launch_ahead = cfg.launch_ahead if cfg.launch_ahead != "auto" else (
            "on" if self.device.type == "cuda" else "off")
        self._last_forward_end: float | None = None  # host clock (CPU)
        self._last_span: ForwardSpan | None = None  # device events (GPU)
        self.eagle = None
        if cfg.spec.enabled:
            from gpu.eagle.spec_worker import EagleWorker
            self.eagle = EagleWorker(self, cfg.spec)
        self.decode_graphs: DecodeGraphs | None = None
        if cfg.cuda_graph_max_batch < 0:
            raise ValueError(f"cuda_graph_max_batch is {cfg.cuda_graph_max_batch}: it must be 0 "
                             f"(no CUDA graphs) or the largest decode batch to capture")
        if cfg.cuda_graph_max_batch and self.device.type == "cuda" and self.eagle is None:
            self.decode_graphs = self.make_decode_graphs(cfg.cuda_graph_max_batch)
            try:
                self.decode_graphs.capture()
            except Exception as exc:
                raise RuntimeError(
                    f"capturing CUDA graphs for decode batches up to "
                    f"{self.decode_graphs.max_batch} failed ({type(exc).__name__}: {exc}); set "
                    f"runtime.cuda_graph_max_batch = 0 to run without them") from exc

    def make_decode_graphs(self, max_batch: int) -> DecodeGraphs:
        """Decode graphs for this runner's model and attention backend, not captured yet (the
        CPU tests capture them as EagerReplay; see gpu/decode_graphs.py)."""
        return DecodeGraphs(self.model, self.attn, min(max_batch, self.num_slots - 1))

    def info(self) -> WorkerInfo:
        mc = self.model_config
        return WorkerInfo(
            protocol_version=WORKER_PROTOCOL_VERSION, model_name=self.model_name,
            device=device_kind(self.device), dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.cfg.attention_backend, num_layers=mc.num_layers,
            vocab_size=mc.vocab_size, max_context_len=self.max_context_len,
            page_size=self.cfg.page_size, num_pages=self.kv_pool.num_pages,
            num_slots=self.num_slots, eos_token_ids=list(mc.eos_token_ids),
            spec_algorithm=self.cfg.spec.algorithm, spec_num_steps=self.cfg.spec.num_steps
            if self.cfg.spec.enabled else 0, spec_reserve_tokens=self.cfg.spec.reserve_tokens)

    # -- plan application -------------------------------------------------------------------

    def _apply_bookkeeping(self, plan: StepPlan) -> None:
        check_plan(plan, self.num_slots, self.kv_pool.num_pages,
                   self.req_to_token.max_context_len, self.model_config.vocab_size)
        released = unpack_i32(plan.released_slots)
        for slot in released.tolist():
            self.sampling_state.release(slot)
        self.future_map.release(host_to_device(released.astype(np.int64), self.device))
        for req in plan.new_requests:
            self.sampling_state.set_request(req.slot, req.params, [], req.output_start)
            if req.cached_ids:  # a borrowed prefix: no prefill chunk will carry it
                self.sampling_state.add_prefill_chunk(req.slot, unpack_i32(req.cached_ids), 0)
        for grant in plan.grants:
            pages = host_to_device(unpack_i32(grant.pages).copy(), self.device)
            self.req_to_token.grant_pages(grant.slot, grant.first_page_index, pages)

    def _build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor, np.ndarray]:
        """Returns the batch, the row index (into requests) of each request that samples, and
        those requests' slots on the host."""
        dev = self.device
        ext_ids, ext_slots, ext_prefix, ext_lens, ext_sample = [], [], [], [], []
        for e in plan.extends:
            ids = unpack_i32(e.token_ids)
            ext_ids.append(ids)
            ext_slots.append(e.slot)
            ext_prefix.append(e.prefix_len)
            ext_lens.append(len(ids))
            ext_sample.append(e.sample)
            self.sampling_state.add_prefill_chunk(e.slot, ids, e.prefix_len)
        decode_host = unpack_i32(plan.decode_slots).astype(np.int64)
        decode_slots = host_to_device(decode_host, dev)
        num_decode = int(decode_slots.shape[0])
        num_extend = len(plan.extends)

        if num_extend:
            e_ids = host_to_device(np.concatenate(ext_ids).astype(np.int64), dev)
            e_slots = host_to_device(np.asarray(ext_slots, dtype=np.int64), dev)
            e_prefix = host_to_device(np.asarray(ext_prefix, dtype=np.int64), dev)
            e_lens = host_to_device(np.asarray(ext_lens, dtype=np.int64), dev)
            cu = torch.cumsum(e_lens, 0) - e_lens
            # output_size: without it repeat_interleave syncs the host with the device.
            e_pos = (torch.arange(int(e_ids.shape[0]), device=dev)
                     - torch.repeat_interleave(cu - e_prefix, e_lens,
                                               output_size=int(e_ids.shape[0])))
        d_prefix = self.future_map.resolve_seq_lens(decode_slots)
        d_ids = self.future_map.resolve_future(decode_slots)
        if num_extend and num_decode:
            mode = ForwardMode.EXTEND
            input_ids = torch.cat([e_ids, d_ids])
            positions = torch.cat([e_pos, d_prefix])
            slots = torch.cat([e_slots, decode_slots])
            prefix_lens = torch.cat([e_prefix, d_prefix])
            extend_lens = torch.cat([e_lens, torch.ones_like(decode_slots)])
        elif num_extend:
            mode = ForwardMode.EXTEND
            input_ids, positions, slots, prefix_lens, extend_lens = e_ids, e_pos, e_slots, e_prefix, e_lens
        else:
            mode = ForwardMode.DECODE if num_decode else ForwardMode.IDLE
            input_ids, positions, slots, prefix_lens = d_ids, d_prefix, decode_slots, d_prefix
            extend_lens = torch.ones_like(decode_slots)
        seq_lens = prefix_lens + extend_lens
        token_slots = (torch.repeat_interleave(slots, extend_lens,
                                               output_size=int(input_ids.shape[0]))
                       if mode == ForwardMode.EXTEND else slots)
        out_cache_loc = self.req_to_token.req_to_token[token_slots, positions].long()
        batch = ForwardBatch(mode=mode, input_ids=input_ids, positions=positions, slots=slots,
                             seq_lens=seq_lens, prefix_lens=prefix_lens, extend_lens=extend_lens,
                             out_cache_loc=out_cache_loc)
        if mode != ForwardMode.IDLE and self.needs_cpu_seq_lens:
            # Host lengths without a device sync: extends' from the plan, decodes' from the
            # FutureMap's host copy of the last publish.
            d_prefix_host = self.future_map.resolve_seq_lens_host(decode_host)
            prefix_host = np.concatenate([np.asarray(ext_prefix, dtype=np.int64), d_prefix_host])
            extend_host = np.concatenate([np.asarray(ext_lens, dtype=np.int64),
                                          np.ones(num_decode, dtype=np.int64)])
            batch.prefix_lens_cpu = torch.from_numpy(prefix_host)
            batch.extend_lens_cpu = torch.from_numpy(extend_host)
            batch.seq_lens_cpu = batch.prefix_lens_cpu + batch.extend_lens_cpu
            batch.seq_lens_sum = int(prefix_host.sum() + extend_host.sum())
            batch.max_seq_len = int((prefix_host + extend_host).max())
            batch.max_extend_len = int(extend_host.max())
        sample_rows = [i for i, s in enumerate(ext_sample) if s] + list(
            range(num_extend, num_extend + num_decode))
        # The sampled slots on the host too, so the sampler needs no device->host sync.
        sample_slots_host = np.concatenate(
            [np.asarray([s for s, smp in zip(ext_slots, ext_sample) if smp], dtype=np.int64),
             decode_host])
        return (batch, host_to_device(np.asarray(sample_rows, dtype=np.int64), dev),
                sample_slots_host)

    @torch.inference_mode()
    def capture_hidden_states_many(self, seqs: list[list[int]], capture_layers: tuple[int, ...]
                                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A teacher-forced prefill of one or more sequences, packed (each attends only to
        itself): the final-normed hidden state of every position and the input residual of each
        layer in `capture_layers` ([n, H] each), rows concatenated in the order given.

        For draft-head training data. It borrows slots 1..len(seqs) and the first pages of the
        pool, so call it only while the runner has no requests (between offline engine runs)."""
        self.streams.synchronize()  # steps launched on other streams are done with the pool
        lens = [len(s) for s in seqs]
        if not 0 < len(seqs) < self.req_to_token.num_slots:
            raise ValueError(f"capture takes 1..{self.req_to_token.num_slots - 1} sequences at "
                             f"once, got {len(seqs)}")
        if not all(0 < n <= self.max_context_len for n in lens):
            raise ValueError(f"capture needs 1..{self.max_context_len} tokens per sequence, "
                             f"got lengths {min(lens)}..{max(lens)}")
        page = self.cfg.page_size
        pages = [-(-n // page) for n in lens]
        if sum(pages) >= self.kv_pool.num_pages:
            raise ValueError(f"{sum(lens)} tokens do not fit the KV pool of "
                             f"{self.kv_pool.num_pages - 1} pages")
        dev = self.device
        first = 1  # page 0 is the pool's padding page
        for slot, k in enumerate(pages, 1):
            self.req_to_token.grant_pages(slot, 0, torch.arange(first, first + k, device=dev))
            first += k
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        slots = torch.arange(1, len(seqs) + 1, dtype=torch.long, device=dev)
        seq_lens = torch.tensor(lens, dtype=torch.long, device=dev)
        out_loc = torch.cat([self.req_to_token.req_to_token[slot, :n]
                             for slot, n in enumerate(lens, 1)]).long()
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=positions,
                             slots=slots, seq_lens=seq_lens, prefix_lens=torch.zeros_like(seq_lens),
                             extend_lens=seq_lens, out_cache_loc=out_loc)
        batch.seq_lens_cpu, batch.seq_lens_sum = torch.tensor(lens), sum(lens)
        batch.prefix_lens_cpu = torch.zeros(len(lens), dtype=torch.long)
        batch.extend_lens_cpu = batch.seq_lens_cpu
        batch.max_seq_len = batch.max_extend_len = max(lens)
        self.attn.init_forward_metadata(batch)
        return self.model.hidden_states(batch, self.attn, capture_layers)

    # -- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor | None, torch.Tensor]:
        """Apply the plan and run the decoder (on the current stream). Returns the batch, the
        final hidden state of every new token (None for an idle batch) and the rows (requests)
        that sample."""
        self._apply_bookkeeping(plan)
        batch, sample_rows, _ = self._build_batch(plan)
        if batch.mode == ForwardMode.IDLE:
            return batch, None, sample_rows
        return batch, self._run_model(batch), sample_rows

    def _run_model(self, batch: ForwardBatch) -> torch.Tensor:
        # The new lengths are known before the forward: publishing them first lets the next
        # plan's host lengths (GPU) wait for this forward's start rather than its end.
        self.future_map.publish(batch.slots, batch.seq_lens)
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs.run(batch)
        self.attn.init_forward_metadata(batch)
        hidden, _ = self.model.hidden_states(batch, self.attn)
        return hidden

    def step(self, plan: StepPlan) -> StepResult:
        """Launch and finish one step (no overlap)."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> PendingStep:
        """Enqueue one step: bookkeeping and batch on the schedule stream, forward, sampling,
        stash and publish on the forward stream, the result's host copy on the copy stream.
        On a GPU this returns before the device has run it; on the CPU it has run."""
        return self.launch_prepared(self.prepare(plan))

    @torch.inference_mode()
    def prepare(self, plan: StepPlan) -> PreparedStep:
        """The first half of `launch`: apply the plan's bookkeeping and build its batch (on the
        schedule stream, which first waits for the previous forward's reads). Call it after the
        previous step's `launch_prepared`; the worker may send that step's result between the
        two halves (launch_ahead "prepare")."""
        start = time.perf_counter()
        step = PreparedStep(plan)
        with self._launch_checks(), self.streams.scheduling():
            self._apply_bookkeeping(plan)
            if self.eagle is None:  # the EAGLE step builds its batches as it goes
                step.batch, step.sample_rows, step.sample_slots_host = self._build_batch(plan)
        step.prepare_s = time.perf_counter() - start
        return step

    @torch.inference_mode()
    def launch_prepared(self, step: PreparedStep) -> PendingStep:
        """The second half of `launch`: the forward, sampling, stash and publish."""
        start = time.perf_counter()
        plan = step.plan
        batch = step.batch
        pending = PendingStep(plan.step_id, 0.0)
        with self._launch_checks(), self.streams.forwarding() as span:
            pending.span = span
            if self.eagle is not None:  # no host sync either: the accept lengths are copied
                pending.eagle_parts = self.eagle.launch(plan)
                pending.copy = self.streams.copy_to_host(
                    self.eagle.outputs_of(pending.eagle_parts))
            elif batch.mode != ForwardMode.IDLE:
                hidden = self._run_model(batch)
                if step.sample_rows.numel():  # else only non-final prefill chunks: nothing to emit
                    pending.copy, pending.n_top = self._sample(batch, hidden, step.sample_rows,
                                                               step.sample_slots_host)
        pending.launch_end = time.perf_counter()
        pending.busy_s = step.prepare_s + pending.launch_end - start
        return pending

    def _launch_checks(self):
        """no_host_sync around preparing and launching when sync_check is on (debug)."""
        return no_host_sync(self.device) if self.sync_check else contextlib.nullcontext()

    def _sample(self, batch: ForwardBatch, hidden: torch.Tensor, sample_rows: torch.Tensor,
                sample_slots_host: np.ndarray) -> tuple[HostCopy, int]:
        last_token = torch.cumsum(batch.extend_lens, 0) - 1
        logits = self.model.logits(hidden[last_token[sample_rows]])
        sample_slots = batch.slots[sample_rows]
        out = self.sampler.sample(logits, sample_slots, batch.seq_lens[sample_rows],
                                  slots_host=sample_slots_host)
        self.future_map.stash(sample_slots, out.token_ids)
        self.sampling_state.record_outputs(sample_slots, out.token_ids)
        outputs = {"slots": sample_slots, "token_ids": out.token_ids}
        if out.logprobs is not None:
            outputs["logprobs"] = out.logprobs.float()
        n_top = 0 if out.top_logprob_ids is None else int(out.top_logprob_ids.shape[1])
        if n_top:
            outputs["top_logprob_ids"] = out.top_logprob_ids
            outputs["top_logprobs"] = out.top_logprobs.float()
        return self.streams.copy_to_host(outputs), n_top

    def finish(self, pending: PendingStep) -> StepResult:
        """Wait for a launched step's result and pack it. Steps finish in launch order."""
        host = pending.copy.wait() if pending.copy is not None else None
        if pending.span is not None:  # GPU: the device's own clock
            pending.span.end.synchronize()
            forward_ms = pending.span.elapsed_ms()
            idle_ms = 0.0 if self._last_span is None else float(
                self._last_span.end.elapsed_time(pending.span.start))
            self._last_span = pending.span
        else:  # CPU: launching is running; idle is the time since the last step's end that
            # this step did not spend preparing or launching (a result sent between the two)
            forward_ms = pending.busy_s * 1e3
            idle_ms = 0.0 if self._last_forward_end is None else max(0.0, (
                pending.launch_end - self._last_forward_end - pending.busy_s) * 1e3)
            self._last_forward_end = pending.launch_end
        if pending.eagle_parts is not None:
            result = self.eagle.finish(pending.step_id, pending.eagle_parts, host)
            return msgspec.structs.replace(result, forward_ms=forward_ms, idle_ms=idle_ms)
        if host is None:
            return StepResult(pending.step_id, b"", b"", b"", 0, b"", b"", forward_ms,
                              idle_ms=idle_ms)
        n_top = pending.n_top
        return StepResult(
            step_id=pending.step_id,
            slots=pack_i32(host["slots"].numpy()),
            token_ids=pack_i32(host["token_ids"].numpy()),
            logprobs=pack_f32(host["logprobs"].numpy()) if "logprobs" in host else b"",
            top_logprobs_n=n_top,
            top_logprob_ids=b"" if n_top == 0 else pack_i32(host["top_logprob_ids"].numpy()),
            top_logprobs=b"" if n_top == 0 else pack_f32(host["top_logprobs"].numpy()),
            forward_ms=forward_ms, idle_ms=idle_ms)
