"""CUDA graphs of the EAGLE decode step: draft tree, verify, accept, commit and draft extend
replayed as one launch per step.

On a GPU the EAGLE step ran op by op and was bound by the host: on an H100 ~760 kernel launches
a token, the device busy 11% of the wall, 41 tok/s against plain decode's ~600 with its graphs
(docs/benchmarks.md). The decode half of the step has static shapes and never waits for the
device (gpu/eagle/eagle_step.py; tests/gpu/test_host_sync.py), so, as SGLang captures its draft
and verify forwards, the whole of it is captured per bucket of batch sizes. Its state is the
FutureMap's buffers (lengths, stashed tokens, the relayed draft top-k and hidden state), which
the graph reads and writes in place; its only input is each row's request slot, and its outputs
the emitted tokens and accept lengths, in static buffers.

- Buckets as gpu/decode_graphs.py's (1, 2, 4, 8, then steps of 16), captured largest first
  into one memory pool. A batch runs the smallest bucket that holds it; the rows past it are
  padding: request slot 0, which is reserved (its req_to_token row is all zeros, so every KV
  write and read of a padding row is the padding location 0). The graph first resets slot 0's
  FutureMap entries (a stashed token, a length of 1), so padding rows start from valid state
  whatever the last replay left there.
- Only batches whose logits processing is the identity take a graph: every row greedy, with no
  penalties, no min-token ban and no logprobs (the flags of a free slot). Others, and batches
  above the largest bucket, run eagerly.
- A step the gate keeps from drafting (gpu/eagle/spec_gate.py) has graphs of its own where the
  head follows every plain step (no HeadLag: on a GPU): the target's decode, the greedy token,
  commit and the draft's one-token extend (`EagleStep.decode_plain`). Eager, that step ran at
  ~17 ms on an H100, and "auto" served 8 streams at 0.17x the plain service.
- The FutureMap's host copy of the published lengths (an event and a second stream) cannot be
  captured: publishing is held inside the graph and made after each replay.

On the CPU there is no graph: `EagerReplay` runs the same function over the same buffers, so the
bucketing, padding and slot-0 reset are tested there exactly as a GPU runs them.
"""

from __future__ import annotations

import bisect
import logging
from functools import partial

import numpy as np
import torch

from gpu.decode_graphs import bucket_sizes, capture_buckets
from gpu.device import host_to_device

log = logging.getLogger(__name__)
PADDING_SLOT = 0


class EagleGraphs:
    """The EAGLE decode step captured for batches of up to ``max_batch`` requests."""

    def __init__(self, step, max_batch: int) -> None:
        self.step = step  # the EagleStep (not imported: it imports this module)
        state = step.state
        self.device = dev = state.device
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        width = step.settings.num_steps + 1
        self.slots = torch.full((self.max_batch,), PADDING_SLOT, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(self.max_batch, width, dtype=torch.long, device=dev)
        self.accept = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.plain_tokens = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        # A free slot's flags: greedy, nothing else; the only batches a graph serves.
        self.flags = state.sampling_state.batch_flags(np.array([PADDING_SLOT]))
        self.graphs: dict[int, object] = {}
        self.plain_graphs: dict[int, object] = {}  # steps without drafting
        self.replays = 0  # steps that ran a graph (tests and benchmarks read it)
        self.plain_replays = 0  # ... of them without drafting
        self.padded_rows = 0  # padding rows those replays ran

    def _forward(self, size: int, drafting: bool = True) -> None:
        fm = self.step.state.future_map
        fm.output_tokens_buf[PADDING_SLOT:PADDING_SLOT + 1].fill_(0)
        fm.new_seq_lens_buf[PADDING_SLOT:PADDING_SLOT + 1].fill_(1)
        fm.hold_notify = True
        try:
            if not drafting:
                self.plain_tokens[:size].copy_(self.step.decode_plain(self.slots[:size]).token_ids)
                return
            tokens, accept = self.step.draft_and_verify(self.slots[:size], None, self.flags)[:2]
        finally:
            fm.hold_notify = False
        self.tokens[:size].copy_(tokens)
        self.accept[:size].copy_(accept)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool; on the CPU, EagerReplay.
        Only padding rows run while capturing: no request's state is touched."""
        self.slots.fill_(PADDING_SLOT)
        self.graphs = capture_buckets(self.sizes, self.device,
                                      lambda size: partial(self._forward, size))
        if self.step.lag is not None:  # plain steps defer the head (gpu/eagle/head_lag.py)
            return
        try:
            self.plain_graphs = capture_buckets(
                self.sizes, self.device, lambda size: partial(self._forward, size, False))
        except Exception as exc:  # noqa: BLE001 - drafting steps keep their graphs
            log.warning("capturing the EAGLE step's graphs of plain steps failed (%s: %s); "
                        "steps without drafting run eagerly", type(exc).__name__, exc)

    def can_run(self, slots_host: np.ndarray, drafting: bool = True) -> bool:
        bs = len(slots_host)
        return (0 < bs <= self.max_batch and bool(self.graphs if drafting else self.plain_graphs)
                and self.step.state.sampling_state.batch_flags(slots_host) == self.flags)

    def _replay(self, graphs: dict[int, object], slots_host: np.ndarray) -> int:
        bs = len(slots_host)
        size = self.sizes[bisect.bisect_left(self.sizes, bs)]
        self.slots[:bs].copy_(host_to_device(slots_host, self.device))
        if size > bs:  # the previous replay may have left live slots there
            self.slots[bs:size].fill_(PADDING_SLOT)
            self.padded_rows += size - bs
        graphs[size].replay()
        self.replays += 1
        self.step.state.future_map.notify_published()
        return bs

    def run(self, slots_host: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of these slots by replay: (emitted tokens [bs, num_steps + 1], -1
        padded, accept lengths [bs]), copies of the static outputs (the next replay, maybe
        launched before this step's result is read, overwrites them)."""
        bs = self._replay(self.graphs, slots_host)
        return self.tokens[:bs].clone(), self.accept[:bs].clone()

    def run_plain(self, slots_host: np.ndarray) -> torch.Tensor:
        """One decode step of these slots without drafting, by replay: the tokens [bs]."""
        self.plain_replays += 1
        bs = self._replay(self.plain_graphs, slots_host)
        return self.plain_tokens[:bs].clone()
