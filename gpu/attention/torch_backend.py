"""Paged attention in plain torch: gather each request's K/V through req_to_token, pad the
batch to its longest sequence, and run one masked SDPA call per layer.

Building the gather indices and masks needs the longest lengths on the host, hence
`needs_cpu_seq_lens = True`. The indices are built once per forward and shared by all layers.

Decode in fp32 on the CPU skips SDPA: with one query per request, two batched products per
kv head over the gathered (strided, uncopied) keys and values are 2-3x faster than the CPU
flash kernel at batch 32, and the same arithmetic in the same precision.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from gpu.device import host_to_device
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool, ReqToTokenPool


class TorchAttentionBackend:
    needs_cpu_seq_lens = True

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self._key_locs: torch.Tensor | None = None  # [bs * max_seq_len] KV locations
        self._mask: torch.Tensor | None = None  # [bs, 1, q_len, max_seq_len] bool
        self._decode_bias: torch.Tensor | None = None  # [bs, 1, max_seq_len] 0 / -inf
        self._query_index: torch.Tensor | None = None  # [bs, max_extend] token index (EXTEND)
        self._query_valid: torch.Tensor | None = None  # [bs, max_extend] bool (EXTEND)
        self._query_rows: torch.Tensor | None = None  # [num_tokens] valid rows of [bs * Lq]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode == ForwardMode.IDLE or batch.batch_size == 0:
            return
        assert batch.seq_lens_cpu is not None and batch.max_seq_len is not None, (
            "the torch attention backend needs host sequence lengths (needs_cpu_seq_lens)")
        device = batch.seq_lens.device
        max_len = batch.max_seq_len
        key_pos = torch.arange(max_len, device=device)
        # Flat, so each layer gathers with index_select (4-5x faster than advanced indexing).
        self._key_locs = self.req_to_token.req_to_token[batch.slots, :max_len].reshape(-1).long()
        in_seq = key_pos[None, :] < batch.seq_lens[:, None]  # [bs, L]
        if batch.mode == ForwardMode.DECODE:
            self._mask = in_seq[:, None, None, :]
            self._decode_bias = torch.zeros(in_seq.shape, dtype=torch.float32, device=device
                                            ).masked_fill_(~in_seq, float("-inf"))[:, None, :]
            return
        max_extend = batch.max_extend_len
        assert max_extend is not None
        j = torch.arange(max_extend, device=device)
        cu_start = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        self._query_valid = j[None, :] < batch.extend_lens[:, None]  # [bs, Lq]
        self._query_index = torch.where(self._query_valid, cu_start[:, None] + j[None, :], 0)
        if batch.tree_mask is not None:
            mask = self._tree_mask(batch, key_pos, in_seq)
        else:
            query_pos = batch.prefix_lens[:, None] + j[None, :]  # [bs, Lq]
            mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_seq[:, None, :]
        # Padded query rows attend to key 0 only, so softmax never sees an all-masked row.
        mask[:, :, 0] |= ~self._query_valid
        self._mask = mask[:, None, :, :]
        # The valid (request, query) rows, from the host lengths: a boolean-mask gather would
        # make the host wait for the device on a GPU.
        lens = batch.extend_lens_cpu.numpy().astype(np.int64)
        starts = np.repeat(np.arange(len(lens)) * max_extend - (np.cumsum(lens) - lens), lens)
        self._query_rows = host_to_device(starts + np.arange(int(lens.sum())), device)

    @staticmethod
    def _tree_mask(batch: ForwardBatch, key_pos: torch.Tensor,
                   in_seq: torch.Tensor) -> torch.Tensor:
        """[bs, Q, L]: keys before seq_len - K visible to all queries, the last K keys looked
        up in ``batch.tree_mask`` [bs, Q, K], keys past seq_len masked."""
        tree_mask = batch.tree_mask.to(torch.bool)
        bs, num_q, num_k = tree_mask.shape
        if bs != batch.batch_size or num_q != batch.max_extend_len or num_q > num_k:
            raise ValueError(f"tree_mask {tuple(tree_mask.shape)} does not fit a batch of "
                             f"{batch.batch_size} requests with {batch.max_extend_len} new "
                             f"tokens each (needs [bs, Q, K] with Q <= K)")
        rel = key_pos[None, :] - (batch.seq_lens[:, None] - num_k)  # [bs, L], tree key index
        in_tree = (rel >= 0) & in_seq
        tree_bits = torch.gather(tree_mask, 2,
                                 rel.clamp(0, num_k - 1)[:, None, :].expand(bs, num_q, -1))
        return (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_bits)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if batch.batch_size == 0:
            return q.new_empty(0, self.num_heads, self.head_dim)
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        bs, max_len = batch.batch_size, batch.max_seq_len
        # [bs, L, kv_heads, D]
        keys = self.kv_pool.k_buffer[layer_id].index_select(0, self._key_locs).to(q.dtype).view(
            bs, max_len, self.num_kv_heads, self.head_dim)
        values = self.kv_pool.v_buffer[layer_id].index_select(0, self._key_locs).to(q.dtype).view(
            bs, max_len, self.num_kv_heads, self.head_dim)
        if (batch.mode == ForwardMode.DECODE and q.device.type == "cpu"
                and q.dtype == torch.float32):
            return self._decode_bmm(q, keys, values)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [bs, kv_heads, L, D]
        if batch.mode == ForwardMode.DECODE:
            queries = q[:, :, None, :]  # [bs, H, 1, D]
        else:
            queries = q[self._query_index].transpose(1, 2)  # [bs, H, Lq, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self._mask,
                                             scale=self.scale, enable_gqa=True)
        if batch.mode == ForwardMode.DECODE:
            return out[:, :, 0, :]
        return out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim).index_select(
            0, self._query_rows)

    def _decode_bmm(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q: [bs, H, D]; keys, values: [bs, L, kv_heads, D]. Returns [bs, H, D]."""
        bs, kv_heads, d = q.shape[0], self.num_kv_heads, self.head_dim
        q = q.view(bs, kv_heads, self.num_heads // kv_heads, d)
        bias = self._decode_bias  # [bs, 1, L]: 0 inside the sequence, -inf in the padding
        if bs == 1:
            # One request: its kv heads are the batch of one bmm, keys and values read in place.
            scores = torch.baddbmm(bias, q[0], keys[0].permute(1, 2, 0), alpha=self.scale)
            out = torch.bmm(torch.softmax(scores, dim=-1), values[0].transpose(0, 1))
            return out.view(1, self.num_heads, d)
        # keys[:, :, h] is [bs, L, D] with unit stride in D: bmm reads it in place.
        scores = torch.stack([torch.baddbmm(bias, q[:, h], keys[:, :, h].transpose(1, 2),
                                            alpha=self.scale) for h in range(kv_heads)], dim=1)
        probs = torch.softmax(scores, dim=-1)  # [bs, kv_heads, group, L]
        out = torch.stack([torch.bmm(probs[:, h], values[:, :, h]) for h in range(kv_heads)], dim=1)
        return out.view(bs, self.num_heads, d)
