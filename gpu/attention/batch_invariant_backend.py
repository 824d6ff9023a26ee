"""Batch-invariant paged attention (`runtime.deterministic`): every query row attends alone,
in fp32, over exactly the keys it sees.

The torch backend pads a batch to its longest sequence and runs one SDPA (or bmm) over it, so
a row's softmax sums over a padded length and its products run in a kernel shaped by the whole
batch: both change the bits with the batch. Here a query at position p multiplies the first
p + 1 keys of its own request, in tensors whose shape and strides depend on p alone, so the
same query gives the same output alone, in any batch, and in any split of its prompt into
prefill chunks. A verify tree's rows see all of their request's keys, the tree's masked by
-inf (the tree is the request's own). One small product per query row and layer: slow for
long prefills, which is the price of the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionBackend, check_tree_mask
from gpu.forward_batch import ForwardBatch, ForwardMode


@dataclass
class _Request:
    key_locs: torch.Tensor  # [seq_len] KV locations
    first_row: int  # its first new token in the batch
    key_counts: list[int]  # per new token: how many keys it sees
    bias: torch.Tensor | None  # [Q, seq_len] 0 / -inf under a tree mask, else None


class BatchInvariantAttentionBackend(AttentionBackend):
    needs_cpu_seq_lens = True

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._requests: list[_Request] = []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._requests = []
        if batch.mode == ForwardMode.IDLE or batch.batch_size == 0:
            return
        assert batch.seq_lens_cpu is not None and batch.max_seq_len is not None, (
            "batch-invariant attention needs host sequence lengths (needs_cpu_seq_lens)")
        seq_lens = batch.seq_lens_cpu.tolist()
        extend_lens = ([1] * len(seq_lens) if batch.mode == ForwardMode.DECODE
                       else batch.extend_lens_cpu.tolist())
        locs = self.req_to_token.req_to_token[batch.slots, :batch.max_seq_len].long()
        tree = batch.tree_mask if batch.mode == ForwardMode.EXTEND else None
        if tree is not None:
            check_tree_mask(batch)
        first_row = 0
        for i, (seq_len, ext) in enumerate(zip(seq_lens, extend_lens)):
            bias = None
            if tree is None:
                counts = list(range(seq_len - ext + 1, seq_len + 1))
            else:
                counts = [seq_len] * ext
                num_k = tree.shape[2]
                bias = torch.zeros(ext, seq_len, device=locs.device)
                bias[:, seq_len - num_k:].masked_fill_(~tree[i].bool(), float("-inf"))
            self._requests.append(_Request(locs[i, :seq_len], first_row, counts, bias))
            first_row += ext

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if batch.batch_size == 0:
            return q.new_empty(0, self.num_heads, self.head_dim)
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        kv_heads, d = self.num_kv_heads, self.head_dim
        out = q.new_empty(q.shape[0], self.num_heads, d)
        for r in self._requests:
            # [kv_heads, D, L] and [kv_heads, L, D], views of [L, kv_heads, D]: a prefix of L
            # keys has the same strides whatever L the request has.
            keys = self.kv_pool.k_buffer[layer_id].index_select(0, r.key_locs).float(
                ).permute(1, 2, 0)
            values = self.kv_pool.v_buffer[layer_id].index_select(0, r.key_locs).float(
                ).transpose(0, 1)
            for j, count in enumerate(r.key_counts):
                row = r.first_row + j
                query = q[row].float().view(kv_heads, -1, d)  # [kv_heads, group, D]
                scores = torch.bmm(query, keys[:, :, :count]).mul_(self.scale)
                if r.bias is not None:
                    scores.add_(r.bias[j])
                probs = torch.softmax(scores, dim=-1)
                out[row] = torch.bmm(probs, values[:, :count]).view(self.num_heads, d)
        return out
