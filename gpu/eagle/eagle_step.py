"""The EAGLE step ("spec v2" shape): the same prepare / launch / finish interface as PlainStep.

The FutureMap protocol of an EAGLE step (every running request's state crosses steps through
it, so a plan never carries a length or a token of a decoding request, and plan k+1 may be
built before step k's result is known):
    prefill:  target forward (capturing the draft's input states) -> sample -> *commit*
              (publish lengths, stash the bonus token, record) -> draft extend over the chunk
              -> *stash_spec* (draft top-k, draft hidden)
    decode:   *resolve* (root token, lengths, draft relay) -> draft `num_steps` levels -> verify
              the tree in one target forward -> accept -> compact the accepted path's KV
              (trees) -> *commit* (new lengths, bonus token, accepted tokens) -> draft extend
              over the accepted tokens -> *stash_spec*
Shapes are static per step (the draft extend covers num_steps + 1 positions, the verify tree
num_draft_tokens nodes): only the result message needs the accept lengths on the host.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from gpu import cpu_decode_step
from gpu.cpu_decode_step import native_decode_applies
from gpu.device import host_to_device
from gpu.eagle.accept import accept_greedy, accept_verified, compact_accepted_kv
from gpu.eagle.drafter import Drafter, SpecBatches
from gpu.eagle.eagle_graphs import EagleGraphs
from gpu.eagle.gate_memory import GateMemory
from gpu.eagle.head_lag import HeadLag, head_regime
from gpu.eagle.headless_steps import HeadlessSteps
from gpu.eagle.host_chain import HostChain
from gpu.eagle.spec_gate import GPU_AUTO_LIMIT, SpecGate
from gpu.eagle.step_outputs import (StepPart, logprob_outputs, merge_logprobs, outputs_of,
                                    pad_to, rows_of, verify_logprobs)
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.plain_step import PlainStep, graphs_apply
from gpu.sampling_state import BatchFlags, SampleOutput
from gpu.step_types import PendingStep, PreparedStep
from gpu.worker_state import WorkerState
from ipc.worker_messages import ExtendEntry, StepResult, pack_i32, unpack_i32

log = logging.getLogger(__name__)


def hidden_size_for(step: "EagleStep | PlainStep") -> int:
    """Width of the target hidden states a step hands its draft head (EAGLE-3: the captured
    layers concatenated; else the final hidden state); idle batches' empty tensors use it."""
    if isinstance(step, EagleStep):
        return step.drafter.head.config.input_hidden_size
    return step.state.model_config.hidden_size


class EagleStep:
    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.settings = settings = state.cfg.spec  # validated with the WorkerConfig
        self.drafter = drafter = Drafter(state, settings)
        self.head = drafter.head
        self.capture_layers = tuple(self.head.config.capture_layers)
        self.needs_cpu_seq_lens = (state.attn.needs_cpu_seq_lens
                                   or drafter.draft_attn.needs_cpu_seq_lens)
        self.batches = SpecBatches(state, self.needs_cpu_seq_lens)
        state.future_map.enable_spec(settings.topk, self.head.config.hidden_size, state.dtype)
        self.max_position = drafter.max_position
        # Not by timing in deterministic mode ("auto" always drafts), nor on TP or DP-attention
        # ranks, each timing itself: every rank must make the same forwards.
        regime = head_regime(state, settings.disable_above_batch_size)
        on_gpu = (state.device.type == "cuda" and not state.cfg.runtime.deterministic
                  and state.dp_attention is None)  # DP ranks draft alike: their own sizes
        self.gate = SpecGate(settings.disable_above_batch_size, measured=regime == "timed",
                             unmeasured_auto=GPU_AUTO_LIMIT if on_gpu or regime == "drop" else 0,
                             drops_heads=regime == "drop")
        # "auto" starts from an earlier run's measurements and keeps its own (gate_memory.py).
        self.gate_memory = GateMemory.for_worker(state) if self.gate.auto else None
        if self.gate_memory is not None:
            self.gate_memory.restore(self.gate)
        # Where the gate times the two ways, plain steps leave the head behind; where it drops
        # heads, requests above the limit run without it (head_lag.py).
        self.lag = HeadLag(self) if regime != "follow" else None
        # Plain decode steps run the target in C as the plain step would, capturing the head's
        # features; a step of headless requests only runs as it does (headless_steps.py).
        self.native_decode = (cpu_decode_step.NativeDecode(state.model, state.attn)
                              if native_decode_applies(state) else None)
        self.headless = (HeadlessSteps(self) if self.lag is not None and (
            self.native_decode is not None or self.gate.drops_heads) else None)
        # The drafting decode step as CUDA graphs where they can be captured (eagle_graphs.py);
        # a failed capture leaves it eager, the reason in the worker's log and ready line.
        self.graphs: EagleGraphs | None = None
        self.graphs_error = ""
        max_batch = state.cfg.runtime.cuda_graph_max_batch
        if max_batch and graphs_apply(state) and not self.needs_cpu_seq_lens:
            try:
                self.use_graphs(max_batch)
            except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly
                self.graphs_error = f"{type(exc).__name__}: {exc}"
                log.warning("capturing the EAGLE step's CUDA graphs failed (%s); it runs "
                            "without them (runtime.cuda_graph_max_batch = 0 skips the try)",
                            self.graphs_error)
        # A chain's greedy drafting steps on a CPU, bookkept on the host (host_chain.py).
        self.host_chain = HostChain(self) if HostChain.applies(self) else None

    def use_graphs(self, max_batch: int) -> EagleGraphs:
        """Capture the drafting decode step for batches up to `max_batch` (on the CPU, where
        there are no graphs, tests replay it eagerly over the same buffers)."""
        graphs = EagleGraphs(self, max_batch)
        graphs.capture()
        self.graphs = graphs
        return graphs

    # -- the interface the Worker calls ------------------------------------------------------

    def prepare(self, step: PreparedStep) -> None:
        """Which requests run headless (gpu/eagle/head_lag.py), by the size of the batch: every
        request the worker holds (many still to prefill). A step of headless requests only
        builds the plain step's batch here, as the plain step does (on a GPU under launch_ahead
        "prepare": while the step before runs); others build their batches as they go."""
        if self.lag is not None:
            self.lag.take_plan(step.plan, self.gate)
        if self.headless is not None and self.headless.applies(
                step.plan, unpack_i32(step.plan.decode_slots)):
            self.headless.prepare(step)

    def launch(self, step: PreparedStep, pending: PendingStep) -> None:
        """Enqueue every kernel of the step, the FutureMap's writes included, and nothing that
        waits for the device, so the host can plan the next step while this one runs
        (tests/gpu/test_host_sync.py checks it)."""
        plan, parts, lag = step.plan, [], self.lag
        decode_host = unpack_i32(plan.decode_slots).astype(np.int64)
        if step.batch is not None:  # prepared as the plain step's (headless requests only)
            return self.headless.launch(step, pending, decode_host)
        prefills, decodes = bool(plan.extends), bool(len(decode_host))
        if not (prefills or decodes):
            self.state.idle_counts["step"] += 1
        if self.state.dp_attention is not None:  # every rank runs the parts any rank runs,
            prefills, decodes = self.state.dp_attention.agree_parts(prefills, decodes)
        drafts = bool(len(decode_host)) and self.gate.drafts(
            len(decode_host), can_draft=lag is None or not lag.any_headless(decode_host))
        if prefills and decodes and not drafts and lag is not None:
            # Chunks and plain decodes in one target forward, as the plain step runs them
            # (the head left behind for the decodes): EAGLE costs nothing where it is off.
            parts.append(self._prefill(plan.extends, decode_host))
            prefills = decodes = False
        if prefills:  # idle where this rank has no chunk: its target forward takes part
            parts.append(self._prefill(plan.extends) if plan.extends else self._idle_prefill())
        if decodes or not (prefills or parts):  # an empty plan runs the decode path idle
            start = time.perf_counter()
            caught = (lag.seconds, lag.tokens) if lag is not None else (0.0, 0)
            parts.append(self._decode(decode_host, drafts))
            # On a CPU: the forwards, less the head's catch-up (the gate charges that apart).
            pending.decode_s = time.perf_counter() - start
            if lag is not None and lag.tokens > caught[1]:
                pending.decode_s -= lag.seconds - caught[0]
                self.gate.record_catch_up(len(decode_host), lag.seconds - caught[0],
                                          lag.tokens - caught[1])
        pending.parts = parts
        pending.copy = self.state.streams.copy_to_host(outputs_of(parts))

    def finish(self, pending: PendingStep, host: dict[str, torch.Tensor]) -> StepResult:
        """The step's result from its parts' outputs, landed on the host (timings left 0)."""
        if pending.headless:
            return self.headless.finish(pending, host)
        rows = rows_of(pending.parts, host)
        decode = pending.parts[-1]
        if len(decode.slots) and pending.decode_s:
            self.gate.record(len(decode.slots), decode.verify, pending.decode_s,
                             rows[-1].num_tokens)
            if self.gate_memory is not None:
                self.gate_memory.after_step(self.gate)
        tokens = [t for r in rows for t in r.tokens]
        logprobs, n_top, top_ids, top_lps = merge_logprobs(rows)
        return StepResult(
            step_id=pending.step_id, slots=pack_i32(np.concatenate([r.slots for r in rows])),
            token_ids=pack_i32(np.concatenate(tokens) if tokens else np.zeros(0)),
            logprobs=logprobs, top_logprobs_n=n_top, top_logprob_ids=top_ids,
            top_logprobs=top_lps, forward_ms=0.0,
            accept_lens=pack_i32(np.concatenate([r.accept_lens for r in rows])))

    # -- forwards ---------------------------------------------------------------------------

    def _target(self, batch: ForwardBatch, capture: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target forward; returns (final hidden, the draft's input features; None without
        `capture`: a batch of headless requests only)."""
        st, native, key_locs = self.state, self.native_decode, None
        layers = self.capture_layers if capture else ()
        if native is not None and native.can_run_as_rows(batch):  # a verify, a short chunk
            batch, key_locs = native.extend_rows(batch)
        if native is not None and native.can_run(batch):
            hidden, captured = native.run_capturing(batch, layers, key_locs)
        elif native is not None and native.can_run_in_pieces(batch):  # as the plain step
            hidden, captured = native.run_in_pieces(batch, layers)
        else:
            if batch.batch_size:
                st.attn.init_forward_metadata(batch)
            else:
                st.idle_counts["target"] += 1
            hidden, captured = st.model.hidden_states(batch, st.attn, layers)
        if not capture:
            return hidden, None
        feats = torch.cat(captured, dim=-1) if captured else hidden
        return hidden, feats.view(-1, hidden_size_for(self))

    def _prefill(self, extends: list[ExtendEntry], plain_decodes: np.ndarray | None = None
                 ) -> StepPart:
        """The chunks' target forward, sampling and draft extend. `plain_decodes`: slots
        that decode without drafting in the same target forward (their rows follow the
        chunks', one token each), the head left behind for them (`HeadLag`)."""
        st, dev, fm = self.state, self.state.device, self.state.future_map
        c = st.prefill_chunks(extends)
        # Checked on the host: the draft extend pairs each position with the next token.
        if any(not e.sample and e.next_token < 0 for e in extends):
            raise ValueError("a non-final prefill chunk came without next_token: the scheduler "
                             "must send one token of lookahead when speculating")
        input_ids, slots, prefix, lens = c.input_ids, c.slots, c.prefix_lens, c.extend_lens
        n_chunk = int(input_ids.shape[0])
        token_slots = torch.repeat_interleave(slots, lens, output_size=n_chunk)
        locs = st.req_to_token.req_to_token[token_slots, c.positions].long()
        chunks = self.batches.make(ForwardMode.EXTEND, input_ids, c.positions, slots, prefix,
                                   lens, prefix + lens, locs)
        batch, decode_host = chunks, np.zeros(0, dtype=np.int64)
        if plain_decodes is not None:
            decode_host = plain_decodes
            d_slots = host_to_device(decode_host, dev)
            d_lens, d_ids = fm.resolve_seq_lens(d_slots), fm.resolve_future(d_slots)
            ones = torch.ones_like(d_lens)
            d_pos = d_lens.clamp(max=self.max_position)
            batch = self.batches.make(
                ForwardMode.EXTEND, torch.cat([input_ids, d_ids]), torch.cat([c.positions, d_pos]),
                torch.cat([slots, d_slots]), torch.cat([prefix, d_lens]), torch.cat([lens, ones]),
                torch.cat([prefix + lens, d_lens + 1]),
                torch.cat([locs, self.batches.locs(d_slots, d_lens[:, None])]))
        lag, chunk_slots = self.lag, [e.slot for e in extends]
        headless = lag is not None and lag.all_headless(chunk_slots)  # no head for the chunks
        hidden, feats = self._target(batch, capture=not (headless and (
            not len(decode_host) or lag.all_headless(decode_host))))
        fm.publish(batch.slots, batch.seq_lens)  # every chunk's length, sampled or not

        last = c.starts + lens - 1
        sample_host = np.array([i for i, e in enumerate(extends) if e.sample], dtype=np.int64)
        sample_rows = host_to_device(sample_host, dev)
        n_sampled, nd = len(sample_host), len(decode_host)
        rows = torch.cat([last[sample_rows], n_chunk + torch.arange(nd, device=dev)])
        sample_slots = torch.cat([slots[sample_rows], batch.slots[len(extends):]])
        slots_host = np.concatenate([np.array([extends[i].slot for i in sample_host],
                                              dtype=np.int64), decode_host])
        seq_rows = torch.cat([sample_rows, len(extends) + torch.arange(nd, device=dev)])
        out = st.sample(hidden[rows], sample_slots, batch.seq_lens[seq_rows], slots_host)
        st.commit(sample_slots, out.token_ids)
        if nd and feats is not None:  # the head runs over the decodes' tokens later, if ever
            lag.defer(decode_host, batch.seq_lens[len(extends):] - 1,
                      out.token_ids[n_sampled:], feats[n_chunk:])
        if headless:
            return StepPart(slots_host, {"tokens": out.token_ids, **logprob_outputs(out)})
        # Draft extend: position t pairs the target's state at t with token t + 1.
        following = host_to_device(np.array([e.next_token for e in extends], dtype=np.int64),
                                   dev)
        following[sample_rows] = out.token_ids[:n_sampled]
        draft_ids = torch.empty_like(input_ids)
        draft_ids[:-1] = input_ids[1:]
        draft_ids[last] = following
        h_out, h_logits = self.drafter.forward(dataclasses.replace(chunks, input_ids=draft_ids),
                                               feats[:n_chunk])
        chunk_rows = last[sample_rows]
        topk_p, topk_ids = self.drafter.topk(h_logits[chunk_rows])
        fm.stash_spec(slots[sample_rows], topk_p, topk_ids, h_out[chunk_rows])
        return StepPart(slots_host, {"tokens": out.token_ids, **logprob_outputs(out)})

    def _idle_prefill(self) -> StepPart:
        """A prefill part of no chunks (DP attention: another rank prefills this step): the
        target forward and the draft extend over zero tokens, the states `hidden_size_for`
        wide."""
        dev = self.state.device
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        batch = self.batches.make(ForwardMode.EXTEND, none, none, none, none, none, none, none)
        _, feats = self._target(batch)
        self.drafter.forward(batch, feats)
        return StepPart(np.zeros(0, dtype=np.int64), {"tokens": none})

    def _decode(self, slots_host: np.ndarray, drafts: bool) -> StepPart:
        """`drafts`: the gate's choice for this batch."""
        st, bs, graphs, lag = self.state, len(slots_host), self.graphs, self.lag
        if drafts and lag is not None:
            lag.catch_up(slots_host)
        # Replays serve plain steps too where the head follows along (no HeadLag: a GPU).
        if graphs is not None and (drafts or lag is None) and graphs.can_run(slots_host, drafts):
            if not drafts:
                return StepPart(slots_host, {"tokens": graphs.run_plain(slots_host)})
            tokens, acc = graphs.run(slots_host)
            return StepPart(slots_host, {"tokens": tokens, "accept": acc}, verify=True)
        slots = host_to_device(slots_host, st.device)
        if bs and not drafts:
            out = self.decode_plain(slots, slots_host)
            return StepPart(slots_host, {"tokens": out.token_ids, **logprob_outputs(out)})
        flags = st.sampler.batch_flags(slots, slots_host)
        if self.host_chain is not None and self.host_chain.can_run(slots_host, flags):
            tokens, acc = self.host_chain.run(slots, slots_host)
            return StepPart(slots_host, {"tokens": tokens, "accept": acc}, verify=True)
        out_tokens, acc, tree, logits, path = self.draft_and_verify(slots, slots_host, flags)
        # Only when a request asks (a host check): no gather of [bs * E, vocab] logits otherwise.
        scored = (verify_logprobs(st.sampler, tree, logits, path, out_tokens, slots, slots_host)
                  if flags.max_logprobs >= 0 else None)
        return StepPart(slots_host, {"tokens": out_tokens, "accept": acc,
                                     **logprob_outputs(scored)}, verify=True)

    def draft_and_verify(self, slots: torch.Tensor, slots_host: np.ndarray | None,
                         flags: BatchFlags) -> tuple:
        """The device half of a drafting decode step, from the FutureMap's state to the next
        step's: draft the tree, verify it, accept, commit, extend the draft over the accepted
        path. Returns (emitted tokens [bs, E] -1 padded, accept lengths, the tree, the verify
        logits or None where the argmax sufficed, the accepted path [bs, E]). Static shapes, no
        host sync: CUDA graphs capture it whole (eagle_graphs.py, `slots_host` None, greedy)."""
        st, s, dev = self.state, self.settings, self.state.device
        bs, T, E = slots.shape[0], s.num_draft_tokens, s.num_steps + 1
        fm, batches = st.future_map, self.batches
        seq_lens = fm.resolve_seq_lens(slots)  # L: tokens in the target's cache
        root = fm.resolve_future(slots)  # the last bonus token, at position L
        topk_p, topk_ids, draft_hidden = fm.resolve_spec(slots)
        tree = self.drafter.tree(batches, slots, seq_lens, root, topk_p, topk_ids, draft_hidden)
        st.check_ranks_agree(tree.tokens)  # every rank verifies the same drafts

        # Verify: node j's KV goes to index L + j; it sits at position L + depth(j).
        cols = torch.arange(T, device=dev)
        positions = (seq_lens[:, None] + tree.depth).clamp_(max=self.max_position)
        batch = batches.make(
            ForwardMode.EXTEND, tree.tokens.reshape(-1), positions.reshape(-1), slots,
            seq_lens, torch.full_like(seq_lens, T), seq_lens + T,
            batches.locs(slots, seq_lens[:, None] + cols),
            tree.mask if s.topk > 1 else None)  # a chain is the ordinary causal extend
        hidden, feats = self._target(batch)
        # Each node's argmax in C where that is all the batch wants (as WorkerState.sample).
        greedy = (st.model.lm_head_tokens(hidden) if slots_host is not None
                  and flags.argmax_only else None)
        if greedy is not None:
            logits, result = None, accept_greedy(tree, greedy.view(bs, T))
        else:
            logits = st.model.logits(hidden)
            result = accept_verified(st.sampler, st.sampling_state, tree, logits, slots,
                                     slots_host, positions, flags)
        acc = result.accept_lens
        if s.topk > 1:
            compact_accepted_kv(self.state.kv_pool, self.state.req_to_token.req_to_token,
                                slots, seq_lens, result)
        emitted = torch.arange(E, device=dev)[None, :] <= acc[:, None]  # [bs, E]
        out_tokens = pad_to(result.accepted_tokens, E)
        # Static shapes: every candidate is recorded, weighted by whether it was emitted.
        st.commit(slots, result.bonus_tokens, seq_lens=seq_lens + acc + 1,
                  emitted=out_tokens.clamp(min=0).reshape(-1),
                  emitted_slots=slots[:, None].expand(-1, E).reshape(-1),
                  weights=emitted.reshape(-1))

        # Draft extend over the accepted path (static width E; rows past the path are scratch).
        path = pad_to(result.path, E).clamp(min=0)
        width = hidden_size_for(self)
        path_feats = feats.view(bs, T, width).gather(1, path[:, :, None].expand(-1, -1, width))
        ext = torch.arange(E, device=dev)
        draft_batch = batches.make(
            ForwardMode.EXTEND, out_tokens.clamp(min=0).reshape(-1),
            (seq_lens[:, None] + ext).clamp_(max=self.max_position).reshape(-1), slots, seq_lens,
            torch.full_like(seq_lens, E), seq_lens + E, batches.locs(slots, seq_lens[:, None] + ext))
        h_out, h_logits = self.drafter.forward(draft_batch, path_feats.reshape(bs * E, width))
        last = torch.arange(bs, device=dev) * E + acc
        next_p, next_ids = self.drafter.topk(h_logits[last])
        fm.stash_spec(slots, next_p, next_ids, h_out[last])
        return out_tokens, acc, tree, logits, path

    def decode_plain(self, slots: torch.Tensor, slots_host: np.ndarray | None = None
                     ) -> SampleOutput:
        """A decode step of a batch the gate keeps from drafting (gpu/eagle/spec_gate.py):
        the target decodes and samples as the plain step does, then the draft extends over
        the token (deferred where the gate is timed: `HeadLag`), so a later, smaller batch
        drafts from here. `slots_host` None: a CUDA graph's capture, greedy rows only."""
        st, batches, fm, lag = self.state, self.batches, self.state.future_map, self.lag
        seq_lens, root = fm.resolve_seq_lens(slots), fm.resolve_future(slots)
        batch = batches.make(ForwardMode.DECODE, root, seq_lens.clamp(max=self.max_position),
                             slots, seq_lens, torch.ones_like(seq_lens), seq_lens + 1,
                             batches.locs(slots, seq_lens[:, None]))
        hidden, feats = self._target(batch, lag is None or not lag.all_headless(slots_host))
        out = (SampleOutput(st.model.logits(hidden).argmax(-1)) if slots_host is None else
               st.sample(hidden, slots, batch.seq_lens, slots_host))
        st.commit(slots, out.token_ids, seq_lens=batch.seq_lens)
        if lag is not None:  # the head runs over this token later, if ever needed
            if feats is not None:
                lag.defer(slots_host, seq_lens, out.token_ids, feats)
            return out
        # Draft extend: the target's state at L paired with the token just sampled (L + 1);
        # the same positions, lengths and KV locations as the target's batch.
        h_out, h_logits = self.drafter.forward(
            dataclasses.replace(batch, input_ids=out.token_ids), feats)
        next_p, next_ids = self.drafter.topk(h_logits)
        fm.stash_spec(slots, next_p, next_ids, h_out)
        return out
