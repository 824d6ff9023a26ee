"""Batch-invariant paged attention (`runtime.deterministic`): every query row attends alone,
in fp32, over exactly the keys it sees.

The torch backend pads a batch to its longest sequence and runs one SDPA (or bmm) over it, so
a row's softmax sums over a padded length and its products run in a kernel shaped by the whole
batch: both change the bits with the batch. Here a query at position p multiplies the first
p + 1 keys of its own request, in tensors whose shape and strides depend on p alone, so the
same query gives the same output alone, in any batch, and in any split of its prompt into
prefill chunks. A verify tree's row gathers just the keys it sees (its prefix, then its
ancestors and itself, in key order), so it computes what a plain decode of the same tokens
would. In a windowed layer a row keeps the last `window` of those keys (a slice of the same
gathered tensor, so again a function of p alone). One small product per query row and layer:
slow for long prefills, which is the price of the mode.
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
    key_counts: list[int]  # per new token: how many keys it sees without a window (the first)
    tree_locs: list[torch.Tensor] | None = None  # per new token of a verify tree: its keys


class BatchInvariantAttentionBackend(AttentionBackend):
    needs_cpu_seq_lens = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._requests: list[_Request] = []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._requests = []
        if batch.mode == ForwardMode.IDLE or batch.batch_size == 0:
            return
        assert batch.seq_lens_cpu is not None and batch.max_seq_len is not None, (
            "batch-invariant attention needs host sequence lengths (needs_cpu_seq_lens)")
        seq_lens = batch.seq_lens_cpu.numpy().tolist()
        extend_lens = ([1] * len(seq_lens) if batch.mode == ForwardMode.DECODE
                       else batch.extend_lens_cpu.numpy().tolist())
        locs = self.req_to_token.req_to_token[batch.slots, :batch.max_seq_len].long()
        tree = None
        if batch.mode == ForwardMode.EXTEND and batch.tree_mask is not None:
            check_tree_mask(batch)
            tree = batch.tree_mask.bool().cpu()  # the tree's rows gather by host indices
        first_row = 0
        for i, (seq_len, ext) in enumerate(zip(seq_lens, extend_lens)):
            r = _Request(locs[i, :seq_len], first_row, list(range(seq_len - ext + 1, seq_len + 1)))
            if tree is not None:
                prefix = seq_len - tree.shape[2]
                r.tree_locs = [torch.cat([r.key_locs[:prefix],
                                          r.key_locs[prefix:][row.to(locs.device)]])
                               for row in tree[i]]
                r.key_counts = [int(t.shape[0]) for t in r.tree_locs]
            self._requests.append(r)
            first_row += ext

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if batch.batch_size == 0:
            return q.new_empty(0, self.num_heads, self.head_dim)
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        kv_heads, d = self.num_kv_heads, self.head_dim
        out = q.new_empty(q.shape[0], self.num_heads, d)
        k_buffer, v_buffer = self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id]
        window = self.layer_window(layer_id)
        for r in self._requests:
            if r.tree_locs is None:
                keys, values = self._gather(k_buffer, v_buffer, r.key_locs)
            for j, count in enumerate(r.key_counts):
                if r.tree_locs is not None:
                    keys, values = self._gather(k_buffer, v_buffer, r.tree_locs[j])
                # A row's keys are a path (the prefix, then its ancestors): the window keeps
                # its last `window`.
                first = 0 if window is None else max(count - window, 0)
                row = r.first_row + j
                query = q[row].float().view(kv_heads, -1, d)  # [kv_heads, group, D]
                scores = torch.bmm(query, keys[:, :, first:count]).mul_(self.scale)
                probs = torch.softmax(scores, dim=-1)
                out[row] = torch.bmm(probs, values[:, first:count]).view(self.num_heads, d)
        return out

    @staticmethod
    def _gather(k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [kv_heads, D, L] and values [kv_heads, L, D] in fp32, views of [L, kv_heads,
        D]: their first n keys have the same strides whatever L is."""
        return (k_buffer.index_select(0, locs).float().permute(1, 2, 0),
                v_buffer.index_select(0, locs).float().transpose(0, 1))
