"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from gpu.forward_batch import ForwardBatch
from gpu.kv_cache import KVPool, ReqToTokenPool


class AttentionBackend(Protocol):
    """Paged attention over the KV pool.

    ``init_forward_metadata`` runs once per forward (index building shared by all layers);
    ``forward`` runs once per layer. ``forward`` first writes the new tokens' k/v into the pool
    at ``batch.out_cache_loc``, then attends each new query to its request's whole sequence
    (cached prefix + new tokens, causal within the new tokens), reading the request's token
    locations from ``req_to_token[slot, :seq_len]``. An EXTEND batch with ``tree_mask`` set
    replaces "causal within the new tokens" by the tree mask over each request's last K keys
    (see ``ForwardBatch.tree_mask``).
    """

    needs_cpu_seq_lens: bool

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float) -> None: ...

    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim] in q's dtype."""
        ...
