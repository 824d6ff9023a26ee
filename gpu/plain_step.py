"""The plain step: one target forward over the plan's prefill chunks and decodes, then sampling.

The FutureMap protocol of a plain step, in order:
    prepare:  apply the plan; *resolve* each decoding slot's input token and length (written
              by the step before, which may not have run yet on a GPU: the device orders it)
    launch:   *publish* the new lengths (before the forward: the next plan's host lengths then
              wait for this forward's start, not its end), run the model, sample, then
              *stash* each sampled token for the next step to resolve (WorkerState.commit)
    finish:   pack the tokens (and logprobs) that reached the host into a StepResult
"""

from __future__ import annotations

import numpy as np
import torch

from gpu import cpu_decode_step
from gpu.cpu_decode_step import native_decode_applies
from gpu.compiled_decode import CompiledDecode, compile_applies, compile_mode
from gpu.decode_graphs import DecodeGraphs
from gpu.device import host_to_device
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.step_streams import HostCopy
from gpu.step_types import PendingStep, PreparedStep
from gpu.worker_state import WorkerState
from ipc.worker_messages import StepPlan, StepResult, pack_f32, pack_i32, unpack_i32


def graphs_apply(state: WorkerState) -> bool:
    """Decode CUDA graphs where they can be captured: a CUDA device, an attention backend that
    reads no host lengths (triton) and one rank (the graphs hold no collectives)."""
    return (state.device.type == "cuda" and not state.attn.needs_cpu_seq_lens
            and state.cfg.parallel.tp == 1)


class PlainStep:
    def __init__(self, state: WorkerState, background_compile: bool = False) -> None:
        """`background_compile`: build the compiled decode step on a thread while decode
        steps run eagerly (the worker process), instead of before returning."""
        self.state = state
        self.needs_cpu_seq_lens = state.attn.needs_cpu_seq_lens
        self.decode_graphs: DecodeGraphs | None = None
        max_batch = state.cfg.runtime.cuda_graph_max_batch
        if max_batch and graphs_apply(state):
            self.decode_graphs = self.make_decode_graphs(max_batch)
            try:
                self.decode_graphs.capture()
            except Exception as exc:
                raise RuntimeError(
                    f"capturing CUDA graphs for decode batches up to "
                    f"{self.decode_graphs.max_batch} failed ({type(exc).__name__}: {exc}); set "
                    f"runtime.cuda_graph_max_batch = 0 to run without them") from exc
        self.native_decode = self.make_native_decode()
        self.compiled_decode = (None if self.native_decode is not None else
                                self.make_compiled_decode(background_compile))

    def make_native_decode(self) -> cpu_decode_step.NativeDecode | None:
        """The decoder as one C call where it applies (gpu/cpu_decode_step.py), unless
        runtime.compile = "on" asks for the compiled torch step: it is faster than that one
        and needs no compile."""
        st = self.state
        if compile_mode(st.cfg.runtime.compile) == "on" or not native_decode_applies(st):
            return None
        return cpu_decode_step.NativeDecode(st.model, st.attn)

    def make_compiled_decode(self, background: bool = False) -> CompiledDecode | None:
        """The compiled decoder where runtime.compile says so (gpu/compiled_decode.py), its
        batch-1 bucket compiled now or set up to build on a thread (Worker.start_background_
        compile starts it); None where decode steps run eagerly."""
        st, rt = self.state, self.state.cfg.runtime
        mode = compile_mode(rt.compile)
        if not compile_applies(mode, st.device, st.dtype, st.attention_backend,
                               rt.deterministic, tp=st.cfg.parallel.tp,
                               kernel_max_rows=st.model.kernel_max_rows):
            return None
        # "auto" builds a larger batch's bucket on a thread the first time one needs it (a
        # cold bucket compiled inside that step would hold every stream ~25 s on 2 cores).
        max_batch = st.num_slots - 1
        if st.model.kernel_max_rows is not None:  # larger batches reach the wide path
            max_batch = min(max_batch, st.model.kernel_max_rows)
        compiled = CompiledDecode(st.model, st.attn, max_batch,
                                  background_buckets=mode == "auto")
        if background:  # a failure is logged and reported as decode_compile "failed"
            compiled.compile_in_background()
            return compiled
        compiled.compile_now(1)
        if mode == "on" and 1 in compiled.failed:
            raise RuntimeError(f"runtime.compile = \"on\": compiling the decode step failed "
                               f"({compiled.failed[1]}); set it to \"auto\" or \"off\"")
        return compiled

    def make_decode_graphs(self, max_batch: int) -> DecodeGraphs:
        """Decode graphs for this model and attention backend, not captured yet (the CPU tests
        capture them as EagerReplay; see gpu/decode_graphs.py)."""
        return DecodeGraphs(self.state.model, self.state.attn,
                            min(max_batch, self.state.num_slots - 1))

    def prepare(self, step: PreparedStep) -> None:
        """Build the step's batch; the plan's bookkeeping is already applied."""
        step.batch, step.sample_rows, step.sample_slots_host = self._build_batch(step.plan)

    def launch(self, step: PreparedStep, pending: PendingStep) -> None:
        """Forward, sampling and commit, enqueued on the current (forward) stream."""
        batch = step.batch
        if batch.mode == ForwardMode.IDLE:
            self.state.idle_counts["step"] += 1
            if self.state.dp_attention is not None:  # the other ranks' MLP collectives wait
                self.run_model(batch)  # for this rank's (empty) part in them
            return
        hidden = self.run_model(batch)
        if step.sample_rows.numel():  # else only non-final prefill chunks: nothing to emit
            pending.copy, pending.n_top = self._sample(batch, hidden, step.sample_rows,
                                                       step.sample_slots_host)

    def forward(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor | None, torch.Tensor]:
        """Apply the plan and run the decoder alone: the batch, the final hidden state of every
        new token (None for an idle batch) and the rows that sample. For tests that compare
        hidden states or logits with a reference."""
        self.state.apply_plan(plan)
        batch, sample_rows, _ = self._build_batch(plan)
        hidden = None if batch.mode == ForwardMode.IDLE else self.run_model(batch)
        return batch, hidden, sample_rows

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        st = self.state
        st.future_map.publish(batch.slots, batch.seq_lens)  # see the module docstring
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs.run(batch)
        native = self.native_decode
        if native is not None and native.can_run(batch):
            return native.run(batch)
        if native is not None and native.can_run_as_rows(batch):  # a short chunk, a mixed
            rows, key_locs = native.extend_rows(batch)  # step: as the EAGLE step's target
            return native.run(rows, key_locs=key_locs)  # runs it, so both give one answer
        if native is not None and native.can_run_in_pieces(batch):  # a prefill of short prompts
            return native.run_in_pieces(batch)[0]
        if self.compiled_decode is not None and self.compiled_decode.can_run(batch):
            return self.compiled_decode.run(batch)
        if batch.batch_size:
            st.attn.init_forward_metadata(batch)
        else:
            st.idle_counts["target"] += 1
        hidden, _ = st.model.hidden_states(batch, st.attn)
        return hidden

    def _sample(self, batch: ForwardBatch, hidden: torch.Tensor, sample_rows: torch.Tensor,
                sample_slots_host: np.ndarray) -> tuple[HostCopy, int]:
        st = self.state
        if batch.mode == ForwardMode.DECODE:  # every row samples its one token: no gathers
            n = batch.batch_size  # (a replayed graph's hidden may hold padding rows after)
            rows_hidden, sample_slots, seq_lens = hidden[:n], batch.slots, batch.seq_lens
        else:
            last_token = torch.cumsum(batch.extend_lens, 0) - 1
            rows_hidden = hidden[last_token[sample_rows]]
            sample_slots, seq_lens = batch.slots[sample_rows], batch.seq_lens[sample_rows]
        out = st.sample(rows_hidden, sample_slots, seq_lens, sample_slots_host)
        st.commit(sample_slots, out.token_ids)  # lengths were published before the forward
        outputs = {"slots": sample_slots, "token_ids": out.token_ids}
        if out.logprobs is not None:
            outputs["logprobs"] = out.logprobs.float()
        n_top = 0 if out.top_logprob_ids is None else int(out.top_logprob_ids.shape[1])
        if n_top:
            outputs["top_logprob_ids"] = out.top_logprob_ids
            outputs["top_logprobs"] = out.top_logprobs.float()
        return st.streams.copy_to_host(outputs), n_top

    def finish(self, pending: PendingStep, host: dict[str, torch.Tensor] | None) -> StepResult:
        """The result from the outputs landed on the host (timings left 0)."""
        if host is None:
            return StepResult(pending.step_id, b"", b"", b"", 0, b"", b"", 0.0)
        n_top = pending.n_top
        return StepResult(
            step_id=pending.step_id,
            slots=pack_i32(host["slots"].numpy()),
            token_ids=pack_i32(host["token_ids"].numpy()),
            logprobs=pack_f32(host["logprobs"].numpy()) if "logprobs" in host else b"",
            top_logprobs_n=n_top,
            top_logprob_ids=b"" if n_top == 0 else pack_i32(host["top_logprob_ids"].numpy()),
            top_logprobs=b"" if n_top == 0 else pack_f32(host["top_logprobs"].numpy()),
            forward_ms=0.0)

    def _build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, torch.Tensor, np.ndarray]:
        """Returns the batch, the row index (into requests) of each request that samples, and
        those requests' slots on the host."""
        st, dev = self.state, self.state.device
        c = st.prefill_chunks(plan.extends) if plan.extends else None
        ext_slots = [e.slot for e in plan.extends]
        ext_sample = [e.sample for e in plan.extends]
        decode_host = unpack_i32(plan.decode_slots).astype(np.int64)
        decode_slots = host_to_device(decode_host, dev)
        num_decode = int(decode_slots.shape[0])
        num_extend = len(plan.extends)

        d_prefix = st.future_map.resolve_seq_lens(decode_slots)
        d_ids = st.future_map.resolve_future(decode_slots)
        if num_extend:  # the decodes (if any) follow the chunks, one new token each
            mode = ForwardMode.EXTEND
            input_ids = torch.cat([c.input_ids, d_ids])
            positions = torch.cat([c.positions, d_prefix])
            slots = torch.cat([c.slots, decode_slots])
            prefix_lens = torch.cat([c.prefix_lens, d_prefix])
            extend_lens = torch.cat([c.extend_lens, torch.ones_like(decode_slots)])
        else:
            mode = ForwardMode.DECODE if num_decode else ForwardMode.IDLE
            input_ids, positions, slots, prefix_lens = d_ids, d_prefix, decode_slots, d_prefix
            extend_lens = torch.ones_like(decode_slots)
        seq_lens = prefix_lens + extend_lens
        token_slots = (torch.repeat_interleave(slots, extend_lens,
                                               output_size=int(input_ids.shape[0]))
                       if mode == ForwardMode.EXTEND else slots)
        out_cache_loc = st.req_to_token.req_to_token[token_slots, positions].long()
        batch = ForwardBatch(mode=mode, input_ids=input_ids, positions=positions, slots=slots,
                             seq_lens=seq_lens, prefix_lens=prefix_lens, extend_lens=extend_lens,
                             out_cache_loc=out_cache_loc)
        if mode != ForwardMode.IDLE and self.needs_cpu_seq_lens:
            # Host lengths without a device sync: extends' from the plan, decodes' from the
            # FutureMap's host copy of the last publish.
            d_prefix_host = st.future_map.resolve_seq_lens_host(decode_host)
            prefix_host = np.concatenate([np.asarray([e.prefix_len for e in plan.extends],
                                                     dtype=np.int64), d_prefix_host])
            extend_host = np.concatenate([c.extend_lens_host if c else np.zeros(0, np.int64),
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
