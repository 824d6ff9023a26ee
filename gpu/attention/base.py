"""The interface every attention backend implements, and what the backends share."""

from __future__ import annotations

import torch

from gpu.forward_batch import ForwardBatch
from gpu.kv_cache import KVPool, ReqToTokenPool


class AttentionBackend:
    """Paged attention over the KV pool.

    ``init_forward_metadata`` runs once per forward (index building shared by all layers);
    ``forward`` runs once per layer. ``forward`` first writes the new tokens' k/v into the pool
    at ``batch.out_cache_loc``, then attends each new query to its request's whole sequence
    (cached prefix + new tokens, causal within the new tokens), reading the request's token
    locations from ``req_to_token[slot, :seq_len]``. An EXTEND batch with ``tree_mask`` set
    replaces "causal within the new tokens" by the tree mask over each request's last K keys
    (see ``ForwardBatch.tree_mask``).

    ``sliding_window`` (Mistral's): a query at position p sees keys p - window + 1 .. p only,
    in every layer, or in the layers of ``window_layers`` only where given (Gemma 3's local
    layers; the others see every key). Keys before the window stay in the pool: no page is
    freed early, so the KV accounting, the prefix cache and overlap see nothing different.
    With a tree mask the window counts along each query's visible keys (see
    ``window_tree_mask``).
    """

    needs_cpu_seq_lens: bool

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None,
                 window_layers: tuple[int, ...] | None = None) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads}) for grouped-query attention")
        if (kv_pool.num_kv_heads, kv_pool.head_dim) != (num_kv_heads, head_dim):
            raise ValueError(
                f"KV pool holds {kv_pool.num_kv_heads} kv heads of dim {kv_pool.head_dim} but "
                f"the backend was built for {num_kv_heads} of dim {head_dim}")
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.window_layers = None if window_layers is None else frozenset(window_layers)
        # The distinct windows of the layers (None: full attention).
        self.windows: tuple[int | None, ...] = (
            (sliding_window,) if sliding_window is None or window_layers is None
            else (None, sliding_window))

    def layer_window(self, layer_id: int) -> int | None:
        if self.window_layers is not None and layer_id not in self.window_layers:
            return None
        return self.sliding_window

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        raise NotImplementedError

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim] in q's dtype."""
        raise NotImplementedError


def check_tree_mask(batch: ForwardBatch) -> None:
    """Shape checks only (no host sync): [bs, Q, K] with Q <= K and bs * Q new tokens."""
    tree_mask = batch.tree_mask
    if tree_mask.dim() != 3 or tree_mask.shape[0] != batch.batch_size:
        raise ValueError(f"tree_mask must be [bs={batch.batch_size}, Q, K] "
                         f"(got {tuple(tree_mask.shape)})")
    bs, num_q, num_k = tree_mask.shape
    if num_q > num_k or bs * num_q != batch.num_tokens:
        raise ValueError(f"tree_mask {tuple(tree_mask.shape)} needs Q <= K and Q new tokens "
                         f"per request (the batch has {batch.num_tokens} for {bs} requests)")


def window_tree_mask(tree_mask: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree mask [bs, Q, K] under a sliding window, and each query's count of visible tree
    keys [bs, Q] (int32).

    A query's visible keys form a path: the prefix, then its ancestors and itself, at
    consecutive positions (a verify tree's node j sits at seq_len - K + depth(j)). So key k is
    ``n`` positions before the query where ``n`` is the number of visible tree keys after k,
    and it is in the window iff n < window; prefix key i (position i) iff
    i >= seq_len - K + count - window. Positions never enter, so this holds however the
    tree's columns are laid out."""
    mask = tree_mask.to(torch.bool)
    visible = mask.to(torch.int32)
    count = visible.sum(-1, dtype=torch.int32)
    after = count[:, :, None] - visible.cumsum(-1, dtype=torch.int32)  # visible keys past k
    return mask & (after < window), count
