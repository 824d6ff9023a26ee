"""One forward pass's inputs, laid out the way the model and attention backends read them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly a chunk, possibly on top of a cached prefix)
    DECODE = "decode"  # exactly one new token per request
    IDLE = "idle"  # no requests: run nothing but keep the same code path


@dataclass
class ForwardBatch:
    """Token-major inputs for one forward.

    Requests are identified by their request slot (row of ``req_to_token``). New tokens of all
    requests are concatenated in slot order: request i owns tokens
    ``[cu_extend[i], cu_extend[i] + extend_lens[i])`` of ``input_ids``.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, position of each new token in its sequence
    slots: torch.Tensor  # [bs] int64, request slot per request
    seq_lens: torch.Tensor  # [bs] int64, sequence length after this forward (prefix + new)
    prefix_lens: torch.Tensor  # [bs] int64, tokens already in the KV cache before this forward
    extend_lens: torch.Tensor  # [bs] int64, new tokens per request (all 1 in DECODE)
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV pool location each new token writes
    # Host copies, only filled when some backend in use declares needs_cpu_seq_lens.
    seq_lens_cpu: torch.Tensor | None = None
    prefix_lens_cpu: torch.Tensor | None = None
    extend_lens_cpu: torch.Tensor | None = None
    seq_lens_sum: int | None = None
    max_seq_len: int | None = None
    max_extend_len: int | None = None
    # EXTEND only (ignored otherwise): tree attention for speculative decoding. [bs, Q, K]
    # bool; every request has extend_lens == Q new tokens and Q <= K <= seq_len. Keys
    # 0 .. seq_len-K-1 of request i (its prefix; prefix_lens == seq_lens - K) are visible to
    # all its queries; key seq_len-K+k is visible to query j iff tree_mask[i, j, k]. The new
    # tokens (written at out_cache_loc) are among those last K keys, anywhere among them.
    # None: the ordinary causal extend.
    tree_mask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.slots.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
