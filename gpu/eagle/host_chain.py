"""A chain's drafting decode step on a CPU, its bookkeeping on the host.

`EagleStep.draft_and_verify` keeps every shape static and every length on the device, so that a
CUDA graph can capture it whole. On a CPU nothing waits for a device, and each of its ~200 small
torch ops (building batches, accepting, committing) costs 2-10 us: ~1.4 ms of a 5.6 ms one-stream
step on the 2-core AVX2 EPYC, more than the draft head itself. Here the same step of a chain's
greedy rows indexes numpy views of the worker's tensors instead and hands the C decode step and
the C head step rows ready-made: the same forwards, tokens and FutureMap writes
(tests/gpu/eagle/test_host_chain.py compares the two step by step).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.sampling_state import BatchFlags
from gpu.sync_guard import expected_sync


def _rows(input_ids, positions, slots, seq_lens, out_loc) -> ForwardBatch:
    """Decode rows (one token each) from host arrays; the tensors share their memory."""
    t = torch.from_numpy
    lens = t(seq_lens)
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=t(input_ids), positions=t(positions),
                        slots=t(slots), seq_lens=lens, prefix_lens=lens - 1,
                        extend_lens=torch.ones_like(lens), out_cache_loc=t(out_loc),
                        max_seq_len=int(seq_lens.max()))


class HostChain:
    """`run` is `EagleStep.draft_and_verify` for a chain of greedy rows (no logprobs) where the
    target's and the head's forwards run in C (`applies`)."""

    def __init__(self, step) -> None:
        st, drafter = step.state, step.drafter
        self.state, self.drafter, self.native = st, drafter, step.native_decode
        self.capture_layers = step.capture_layers
        self.width = drafter.head.config.input_hidden_size  # the captured features' width
        self.steps = step.settings.num_steps
        self.max_position = step.max_position
        self.table = st.req_to_token.req_to_token.numpy()  # a view: CPU tensors share memory
        self.runs = 0  # steps run here (tests read it)

    @staticmethod
    def applies(step) -> bool:
        st = step.state
        return (st.device.type == "cpu" and step.drafter.chain and step.graphs is None
                and step.native_decode is not None and step.drafter.native is not None)

    def can_run(self, slots_host: np.ndarray, flags: BatchFlags) -> bool:
        rows = len(slots_host) * (self.steps + 1)
        return (flags.argmax_only and 0 < rows <= self.native.max_batch
                and rows <= self.drafter.native.max_rows)

    def run(self, slots: torch.Tensor, slots_host: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(emitted tokens [bs, steps + 1], -1 padded; accepted drafts [bs])."""
        with expected_sync():  # host reads: on a CPU nothing waits
            return self._run(slots, slots_host)

    def _run(self, slots: torch.Tensor, slots_host: np.ndarray
             ) -> tuple[torch.Tensor, torch.Tensor]:
        st, fm, drafter = self.state, self.state.future_map, self.drafter
        bs, E = len(slots_host), self.steps + 1
        slots_host = slots_host.astype(np.int64, copy=False)
        lens = fm.resolve_seq_lens(slots).numpy()  # L: the WRWR checks as the device path's
        root = fm.resolve_future(slots)
        _, first, hidden = fm.resolve_spec(slots)
        # The drafts: level 0 relayed, each later level one head forward from the last.
        drafts, ids, hid = [first], first.reshape(-1), hidden
        for i in range(1, self.steps):
            at = lens + i - 1
            h_out, h_logits = drafter.native.forward(self._head_rows(
                ids.numpy(), at, slots_host, at + 1), hid)
            ids = drafter.topk(h_logits)[1].reshape(-1)
            drafts.append(ids[:, None])
            hid = h_out
        tokens = torch.cat([root[:, None], *drafts], dim=1).numpy()  # [bs, E]

        # Verify: node j at position L + j, its KV at index L + j, seeing L + j + 1 keys.
        at = (lens[:, None] + np.arange(E)).reshape(-1)
        row_slots = np.repeat(slots_host, E)
        hidden_out, captured = self.native.run_capturing(
            _rows(tokens.reshape(-1), np.minimum(at, self.max_position), row_slots, at + 1,
                  self.table[row_slots, at].astype(np.int64)), self.capture_layers)
        feats = torch.cat(captured, dim=-1) if captured else hidden_out
        greedy = st.model.lm_head_tokens(hidden_out)
        if greedy is None:
            greedy = st.model.logits(hidden_out).argmax(-1)
        argmax = greedy.numpy().reshape(bs, E)

        # Accept: the leading drafts that equal the argmax before them; each accepted draft is
        # that argmax and the bonus the one after the last, so the argmaxes are the emitted.
        acc = np.cumprod(tokens[:, 1:] == argmax[:, :-1], axis=1).sum(axis=1)
        kept = np.arange(E) <= acc[:, None]
        emitted = np.where(kept, argmax, -1)
        bonus = argmax[np.arange(bs), acc]
        t = torch.from_numpy
        st.commit(slots, t(bonus), seq_lens=t(lens + acc + 1),
                  emitted=t(np.maximum(emitted, 0).reshape(-1)), emitted_slots=t(row_slots),
                  weights=t(kept.reshape(-1)))

        # The head over the accepted path (rows past it are scratch, as the device path's).
        path = np.where(kept, np.arange(E), 0) + (np.arange(bs) * E)[:, None]
        h_out, h_logits = drafter.native.forward(
            self._head_rows(np.maximum(emitted, 0).reshape(-1), at, row_slots, at + 1),
            feats[t(path.reshape(-1))])
        last = t(np.arange(bs) * E + acc)
        next_p, next_ids = drafter.topk(h_logits[last])
        fm.stash_spec(slots, next_p, next_ids, h_out[last])
        self.runs += 1
        return t(emitted), t(acc)

    def _head_rows(self, input_ids, at, slots, seq_lens) -> ForwardBatch:
        """The head's rows: token t at position `at`, its draft KV at index `at`."""
        return _rows(np.ascontiguousarray(input_ids, dtype=np.int64),
                     np.minimum(at, self.max_position), slots, seq_lens,
                     self.table[slots, at].astype(np.int64))
