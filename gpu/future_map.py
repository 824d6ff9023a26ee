"""The FutureMap: per-slot relay buffers that let plan k+1 run before step k's result is known.

A decode entry in a plan carries only its request slot. After sampling, step k *stashes* each
request's token into `output_tokens_buf[slot]` and *publishes* its new length into
`new_seq_lens_buf[slot]`; step k+1 *resolves* its inputs from the same slots before the forward
reads them. Every buffer is indexed by request slot (slot 0 is padding), and there is one output
buffer for every mode (the sampled token now; EAGLE's bonus token later).

Debug invariant (FMSERVE_WRWR_CHECK=1 or `runtime.wrwr_check`): each slot of the token buffer
must alternate write, read, write, read. Empty slots hold -1; a resolve asserts every value it
gathers is >= 0 and writes -1 back (a read before any write fails), and a stash asserts the
slots it writes are empty (a double write fails). Resolved lengths must be > 0.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from gpu.device import new_event
from gpu.sync_guard import expected_sync

EMPTY = -1


class FutureMapInvariantError(AssertionError):
    pass


def wrwr_check_from_env() -> bool:
    return os.environ.get("FMSERVE_WRWR_CHECK", "0").lower() in ("1", "true", "yes", "on")


def _check_all(cond: torch.Tensor, message: str, slots: torch.Tensor) -> None:
    if cond.device.type == "cpu":  # the value is at hand: raise a readable error
        with expected_sync():
            if not bool(cond.all()):
                raise FutureMapInvariantError(f"{message} (slots {slots[~cond].tolist()})")
    else:  # no host sync on a GPU: the device raises at the next synchronisation. Its message
        # is fixed text (no slot list: reading one would sync, and CUDA caps it at 255 bytes).
        torch._assert_async(cond.all(), message[:250])


class FutureMap:
    def __init__(self, num_slots: int, device: torch.device, wrwr_check: bool | None = None) -> None:
        self.device = device
        self.wrwr_check = wrwr_check_from_env() if wrwr_check is None else wrwr_check
        fill = EMPTY if self.wrwr_check else 0
        self.output_tokens_buf = torch.full((num_slots,), fill, dtype=torch.long, device=device)
        self.new_seq_lens_buf = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.publish_ready = None  # created lazily from the device's own module
        # On a GPU the published lengths also go to a pinned host buffer on a side stream, so a
        # backend that needs host lengths waits for the last publish, not for the whole step.
        self._lens_host: torch.Tensor | None = None
        self._lens_stream = None
        self._lens_copied = None
        self.hold_notify = False  # publish without notify_published (inside a CUDA graph)
        # EAGLE's relay (enable_spec): the draft's top-k for the next root and its hidden state.
        self.topk_p_buf: torch.Tensor | None = None
        self.topk_index_buf: torch.Tensor | None = None
        self.hidden_buf: torch.Tensor | None = None

    def enable_spec(self, topk: int, hidden_size: int, dtype: torch.dtype) -> None:
        n = self.output_tokens_buf.shape[0]
        self.topk_p_buf = torch.zeros(n, topk, dtype=torch.float32, device=self.device)
        self.topk_index_buf = torch.zeros(n, topk, dtype=torch.long, device=self.device)
        self.hidden_buf = torch.zeros(n, hidden_size, dtype=dtype, device=self.device)

    # -- written after sampling, in stream order ---------------------------------------------

    def stash(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        if slots.numel() == 0:  # an idle batch stashes nothing
            return
        if self.wrwr_check:
            _check_all(self.output_tokens_buf[slots] == EMPTY,
                       "FutureMap WRWR violation: double write (stash into a slot whose token "
                       "was never read)", slots)
        self.output_tokens_buf.index_copy_(0, slots, token_ids.to(torch.long))

    def stash_spec(self, slots: torch.Tensor, topk_p: torch.Tensor, topk_index: torch.Tensor,
                   hidden: torch.Tensor) -> None:
        """The draft state the next step starts from (written with the bonus token)."""
        if slots.numel() == 0:
            return
        self.topk_p_buf.index_copy_(0, slots, topk_p.float())
        self.topk_index_buf.index_copy_(0, slots, topk_index.long())
        self.hidden_buf.index_copy_(0, slots, hidden.to(self.hidden_buf.dtype))

    def publish(self, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self.new_seq_lens_buf.index_copy_(0, slots, seq_lens.to(torch.long))
        if not self.hold_notify:
            self.notify_published()

    def notify_published(self) -> None:
        """Mark the lengths published so far as ready, and start their copy to the host on a
        GPU. Held (`hold_notify`) inside a CUDA graph, which cannot hold the copy's event and
        stream: the graph's caller notifies after each replay (gpu/eagle/eagle_graphs.py)."""
        if self.publish_ready is None:
            self.publish_ready = new_event(self.device)
        self.publish_ready.record()
        if self.device.type == "cuda":
            self._copy_lens_to_host()

    def _copy_lens_to_host(self) -> None:
        if self._lens_stream is None:
            self._lens_stream = torch.cuda.Stream(self.device)
            self._lens_host = torch.zeros(self.new_seq_lens_buf.shape, dtype=torch.long,
                                          pin_memory=True)
            self._lens_copied = torch.cuda.Event()
        self._lens_stream.wait_event(self.publish_ready)
        with torch.cuda.stream(self._lens_stream):
            self._lens_host.copy_(self.new_seq_lens_buf, non_blocking=True)
        self._lens_copied.record(self._lens_stream)

    # -- read before the next forward ---------------------------------------------------------

    def resolve_future(self, slots: torch.Tensor) -> torch.Tensor:
        """The input token of each decoding slot: the token its previous step stashed."""
        tokens = self.output_tokens_buf[slots]
        if self.wrwr_check and slots.numel():
            _check_all(tokens >= 0, "FutureMap WRWR violation: read before write (a decode "
                                    "read a slot with no stashed token)", slots)
            self.output_tokens_buf.index_fill_(0, slots, EMPTY)
        return tokens

    def resolve_spec(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The relayed draft state of each decoding slot: (top-k probs, top-k ids, hidden)."""
        return self.topk_p_buf[slots], self.topk_index_buf[slots], self.hidden_buf[slots]

    def resolve_seq_lens(self, slots: torch.Tensor) -> torch.Tensor:
        """Each slot's length in the KV cache as the last step left it."""
        lens = self.new_seq_lens_buf[slots]
        if self.wrwr_check and slots.numel():
            _check_all(lens > 0, "FutureMap: resolved a sequence length <= 0 (a slot "
                                 "decoded before its prefill published)", slots)
        return lens

    def resolve_seq_lens_host(self, slots_host: np.ndarray) -> np.ndarray:
        """The lengths `resolve_seq_lens` gives, read on the host: from the buffer itself on the
        CPU, from the pinned copy of the last publish on a GPU (waiting for that copy only)."""
        if self.device.type != "cuda":
            with expected_sync():  # the buffer is on the host already
                lens = self.new_seq_lens_buf.numpy()[slots_host]
        elif self._lens_host is None:  # nothing published yet
            lens = np.zeros(len(slots_host), dtype=np.int64)
        else:
            self._lens_copied.synchronize()
            lens = self._lens_host.numpy()[slots_host]
        if self.wrwr_check and len(slots_host) and not (lens > 0).all():
            raise FutureMapInvariantError(
                f"FutureMap: resolved a host sequence length <= 0 at slots "
                f"{np.asarray(slots_host).tolist()} (a slot decoded before its prefill published)")
        return lens

    @staticmethod
    def resolve_seq_lens_cpu(seq_lens: torch.Tensor, needs_cpu: bool
                             ) -> tuple[torch.Tensor | None, int | None]:
        """The host copy of the lengths and their sum, only when some backend needs them."""
        if not needs_cpu:
            return None, None
        with expected_sync():  # the backend in use declared it needs them
            cpu = seq_lens.cpu()
            return cpu, int(cpu.sum())

    def release(self, slots: torch.Tensor) -> None:
        """A request left its slot: whatever it stashed last will never be read."""
        if slots.numel():
            self.output_tokens_buf.index_fill_(0, slots, EMPTY if self.wrwr_check else 0)
            self.new_seq_lens_buf.index_fill_(0, slots, 0)
