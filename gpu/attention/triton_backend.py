"""Paged attention with Triton kernels (split-K decode, causal extend over req_to_token).

Everything the kernels need stays on the device: grid sizes come from tensor shapes
(``batch_size``, ``num_tokens``) and the kernels read lengths from device tensors, so this
backend never needs host copies of the sequence lengths (``needs_cpu_seq_lens = False``).
Per-forward metadata (query offsets, extend block schedule, decode scratch) is built once in
``init_forward_metadata`` and shared by all layers. An EXTEND batch's ``tree_mask`` goes to
the extend kernel as is (its K comes from the mask's shape, the tree's start from
``seq_lens - K`` on the device), in a windowed layer as ``window_tree_mask`` makes it (once
per forward). On CPU the kernels run under the Triton interpreter only; see
``gpu.attention.triton_common`` for how to enable it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.attention import triton_decode, triton_extend
from gpu.attention.base import AttentionBackend, check_tree_mask, window_tree_mask
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool, ReqToTokenPool


@dataclass
class _ForwardMetadata:
    batch: ForwardBatch  # the batch this was built for (forward checks identity)
    # DECODE: split-K scratch, overwritten by every layer.
    mid_out: torch.Tensor | None = None  # [bs, num_heads, num_splits, head_dim] fp32
    mid_lse: torch.Tensor | None = None  # [bs, num_heads, num_splits] fp32
    # EXTEND
    query_start: torch.Tensor | None = None  # [bs] first row of each request's new tokens
    block_req: torch.Tensor | None = None  # [grid] request of each query block
    block_m: torch.Tensor | None = None  # [grid] index of the block within its request
    # A tree mask under each window of the layers: (windowed mask, visible tree keys per query)
    tree_by_window: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None


class TritonAttentionBackend(AttentionBackend):
    needs_cpu_seq_lens = False

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None,
                 window_layers: tuple[int, ...] | None = None,
                 num_kv_splits: int = triton_decode.DEFAULT_NUM_KV_SPLITS) -> None:
        super().__init__(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, scale,
                         sliding_window, window_layers)
        if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
            raise ValueError(f"num_kv_splits must be a power of two (got {num_kv_splits})")
        self.num_kv_splits = num_kv_splits
        self._meta: _ForwardMetadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        meta = _ForwardMetadata(batch=batch)
        bs = batch.batch_size
        device = batch.seq_lens.device
        if bs == 0 or batch.mode == ForwardMode.IDLE:
            pass
        elif batch.mode == ForwardMode.DECODE:
            meta.mid_out = torch.empty(bs, self.num_heads, self.num_kv_splits, self.head_dim,
                                       dtype=torch.float32, device=device)
            meta.mid_lse = torch.empty(bs, self.num_heads, self.num_kv_splits,
                                       dtype=torch.float32, device=device)
        else:
            if batch.tree_mask is not None:
                check_tree_mask(batch)
                meta.tree_by_window = {w: window_tree_mask(batch.tree_mask, w)
                                       for w in self.windows if w is not None}
            meta.query_start = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
            meta.block_req, meta.block_m = triton_extend.extend_block_schedule(
                batch.extend_lens, batch.num_tokens)
        self._meta = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if batch.batch_size == 0 or batch.mode == ForwardMode.IDLE:
            return q.new_empty(0, self.num_heads, self.head_dim)
        if self._meta is None or self._meta.batch is not batch:
            self.init_forward_metadata(batch)
        meta = self._meta
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        k_buffer = self.kv_pool.k_buffer[layer_id]
        v_buffer = self.kv_pool.v_buffer[layer_id]
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype,
                          device=q.device)
        table = self.req_to_token.req_to_token
        window = self.layer_window(layer_id)
        if batch.mode == ForwardMode.DECODE:
            triton_decode.decode_attention(q, k_buffer, v_buffer, out, table, batch.slots,
                                            batch.seq_lens, meta.mid_out, meta.mid_lse,
                                            self.scale, window)
        else:
            tree_mask, tree_count = batch.tree_mask, None
            if tree_mask is not None and window is not None:
                tree_mask, tree_count = meta.tree_by_window[window]
            triton_extend.extend_attention(q, k_buffer, v_buffer, out, table, batch.slots,
                                            batch.prefix_lens, batch.extend_lens,
                                            meta.query_start, meta.block_req, meta.block_m,
                                            self.scale, seq_lens=batch.seq_lens,
                                            tree_mask=tree_mask, window=window,
                                            tree_count=tree_count)
        return out
