"""Paged attention in plain torch: gather each request's K/V through req_to_token, pad the
batch to its longest sequence, and run one masked SDPA call per layer.

Building the gather indices and masks needs the longest lengths on the host, hence
`needs_cpu_seq_lens = True`. The indices are built once per forward and shared by all layers.

A continuous-batching step mixes decodes (one new token) with prefill chunks (hundreds). Padded
together, every decode would run as many query rows as the longest chunk, so a mixed EXTEND
batch runs as two groups: its decodes as one batched decode, its chunks padded among themselves.
A model whose layers mix windowed and full attention (Gemma 3) gets the groups once per window.

On a CPU a chunk group without a tree mask or window attends request by request, each with
exactly its own keys (`_Ragged`): padded, a wave of 32 prompts of 42-181 tokens spent twice
the time in SDPA over padding (26 against 13 ms a layer on a 2-core EPYC).

Decode in fp32 on the CPU skips SDPA: with one query per request, two batched products per
kv head over the gathered (strided, uncopied) keys and values are 2-3x faster than the CPU
flash kernel at batch 32, and the same arithmetic in the same precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionBackend, check_tree_mask, window_tree_mask
from gpu.device import host_to_device
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool, ReqToTokenPool


# Chunk groups of fewer tokens (an EAGLE head's few accepted tokens a step) stay padded: their
# padding is small, and a mask per request would cost more than it saves.
RAGGED_MIN_TOKENS = 64


@dataclass
class _Ragged:
    """One request of a chunk group attended alone: its query rows [start, start + length) of
    the group's tokens, its keys' locations, and its mask (None: plain causal, no prefix)."""
    start: int
    length: int
    key_locs: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # [length, seq_len] bool, query i sees keys up to prefix + i


@dataclass
class _Group:
    """Some requests of a batch, attended together: keys padded to their longest sequence,
    queries to their longest extend (1 for a decode group)."""
    size: int  # requests
    max_len: int  # keys per request (padded)
    key_locs: torch.Tensor  # [size * max_len] KV locations
    mask: torch.Tensor  # [size, 1, Lq, max_len] bool
    decode_bias: torch.Tensor | None = None  # [size, 1, max_len] 0 / -inf (decode groups)
    query_index: torch.Tensor | None = None  # [size, Lq] token index into q (extend groups)
    query_rows: torch.Tensor | None = None  # valid rows of [size * Lq], in token order
    tokens: torch.Tensor | None = None  # the batch's token rows this group owns, in order;
    # None: all of them (the group is the whole batch)
    ragged: list[_Ragged] | None = None  # set: attend request by request, not padded

    @property
    def decode(self) -> bool:
        return self.decode_bias is not None


class TorchAttentionBackend(AttentionBackend):
    needs_cpu_seq_lens = True

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None,
                 window_layers: tuple[int, ...] | None = None) -> None:
        super().__init__(kv_pool, req_to_token, num_heads, num_kv_heads, head_dim, scale,
                         sliding_window, window_layers)
        self._groups: list[_Group] = []  # the forward's groups under the first window
        self._groups_by_window: dict[int | None, list[_Group]] = {}

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._groups, self._groups_by_window = [], {}
        if batch.mode == ForwardMode.IDLE or batch.batch_size == 0:
            return
        assert batch.seq_lens_cpu is not None and batch.max_seq_len is not None, (
            "the torch attention backend needs host sequence lengths (needs_cpu_seq_lens)")
        # A window no shorter than the longest sequence hides no key: those layers take the
        # full-attention groups (on a CPU request by request, not padded under a mask).
        built: dict[int | None, list[_Group]] = {}
        for w in self.windows:
            seen = None if w is None or w >= batch.max_seq_len else w
            if seen not in built:
                built[seen] = self._build_groups(batch, seen)
            self._groups_by_window[w] = built[seen]
        self._groups = self._groups_by_window[self.windows[0]]

    def _build_groups(self, batch: ForwardBatch, window: int | None) -> list[_Group]:
        if batch.mode == ForwardMode.DECODE:
            return [self._decode_group(batch.slots, batch.seq_lens, batch.max_seq_len, window)]
        ext = batch.extend_lens_cpu.numpy().astype(np.int64)
        starts = np.cumsum(ext) - ext  # each request's first token row
        single = ext == 1
        if batch.tree_mask is not None or single.all() or not single.any():
            return [self._extend_group(batch, ext, starts, None, window)]
        device = batch.seq_lens.device
        lens = batch.seq_lens_cpu.numpy()
        rows = np.flatnonzero(single)
        index = host_to_device(rows, device)
        group = self._decode_group(batch.slots[index], batch.seq_lens[index],
                                   int(lens[rows].max()), window)
        group.tokens = host_to_device(starts[rows], device)
        return [group, self._extend_group(batch, ext, starts, np.flatnonzero(~single), window)]

    def _decode_group(self, slots: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                      window: int | None) -> _Group:
        return self.decode_group_of(*self.decode_inputs(slots, seq_lens, max_len, window))

    def decode_inputs(self, slots: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                      window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode group's metadata as tensors: key locations [n, max_len] and the additive
        mask [n, 1, max_len] (0 inside the sequence or window, -inf past it). The compiled
        decode step (gpu/compiled_decode.py) takes them as graph inputs."""
        key_pos = torch.arange(max_len, device=seq_lens.device)[None, :]
        in_seq = key_pos < seq_lens[:, None]
        if window is not None:
            in_seq &= key_pos >= seq_lens[:, None] - window
        bias = torch.zeros(in_seq.shape, dtype=torch.float32, device=seq_lens.device
                           ).masked_fill_(~in_seq, float("-inf"))[:, None, :]
        return self.req_to_token.req_to_token[slots, :max_len].long(), bias

    @staticmethod
    def decode_group_of(key_locs: torch.Tensor, bias: torch.Tensor) -> _Group:
        n, max_len = key_locs.shape
        # Flat, so each layer gathers with index_select (4-5x faster than advanced indexing).
        return _Group(n, max_len, key_locs.reshape(-1), torch.isfinite(bias)[:, :, None, :],
                      bias)

    def _extend_group(self, batch: ForwardBatch, ext_host: np.ndarray, starts_host: np.ndarray,
                      rows: np.ndarray | None, window: int | None) -> _Group:
        """The extend requests `rows` (host indices into the batch; None: all of them), given
        every request's extend length and first token row on the host."""
        device = batch.seq_lens.device
        if rows is None:
            slots, seq_lens = batch.slots, batch.seq_lens
            prefix_lens, extend_lens = batch.prefix_lens, batch.extend_lens
            max_len, max_extend = batch.max_seq_len, batch.max_extend_len
            lens, cu_start = ext_host, batch.extend_lens.cumsum(0) - batch.extend_lens
            tokens = None
        else:
            index = host_to_device(rows, device)
            slots, seq_lens = batch.slots[index], batch.seq_lens[index]
            prefix_lens, extend_lens = batch.prefix_lens[index], batch.extend_lens[index]
            max_len = int(batch.seq_lens_cpu.numpy()[rows].max())
            lens = ext_host[rows]
            max_extend = int(lens.max())
            cu_start = host_to_device(np.cumsum(lens) - lens, device)  # in the group's rows
            tokens = host_to_device(np.concatenate([np.arange(s, s + n) for s, n in
                                                    zip(starts_host[rows], lens)]), device)
        assert max_extend is not None
        key_pos = torch.arange(max_len, device=device)
        locs = self.req_to_token.req_to_token[slots, :max_len].reshape(-1).long()
        in_seq = key_pos[None, :] < seq_lens[:, None]  # [n, L]
        j = torch.arange(max_extend, device=device)
        valid = j[None, :] < extend_lens[:, None]  # [n, Lq]
        query_index = torch.where(valid, cu_start[:, None] + j[None, :], 0)
        if batch.tree_mask is not None:
            check_tree_mask(batch)
            mask = self._tree_mask(batch, key_pos, in_seq, window)
        else:
            query_pos = prefix_lens[:, None] + j[None, :]  # [n, Lq]
            mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & in_seq[:, None, :]
            if window is not None:
                mask &= key_pos[None, None, :] > query_pos[:, :, None] - window
        # Padded query rows attend to key 0 only, so softmax never sees an all-masked row.
        mask[:, :, 0] |= ~valid
        # The valid (request, query) rows, from the host lengths: a boolean-mask gather would
        # make the host wait for the device on a GPU.
        firsts = np.repeat(np.arange(len(lens)) * max_extend - (np.cumsum(lens) - lens), lens)
        query_rows = host_to_device(firsts + np.arange(int(lens.sum())), device)
        group = _Group(int(slots.shape[0]), max_len, locs, mask[:, None, :, :],
                       query_index=query_index, query_rows=query_rows, tokens=tokens)
        if (device.type == "cpu" and batch.tree_mask is None and window is None
                and int(lens.sum()) >= RAGGED_MIN_TOKENS):
            seq_host = batch.seq_lens_cpu.numpy()[rows if rows is not None else slice(None)]
            group.ragged = self._ragged(locs.view(len(lens), max_len), lens, seq_host)
        return group

    @staticmethod
    def _ragged(locs: torch.Tensor, lens: np.ndarray, seq_lens: np.ndarray) -> list[_Ragged]:
        out, start = [], 0
        for i, (length, seq_len) in enumerate(zip(lens.tolist(), seq_lens.tolist())):
            prefix, mask = seq_len - length, None
            if prefix:  # bottom-right causal: SDPA's is_causal aligns top-left
                mask = torch.ones(length, seq_len, dtype=torch.bool).tril(prefix)
            out.append(_Ragged(start, length, locs[i, :seq_len], mask))
            start += length
        return out

    @staticmethod
    def _tree_mask(batch: ForwardBatch, key_pos: torch.Tensor, in_seq: torch.Tensor,
                   window: int | None) -> torch.Tensor:
        """[bs, Q, L]: keys before seq_len - K visible to all queries (with a window, to those
        it reaches), the last K keys looked up in ``batch.tree_mask`` [bs, Q, K] (windowed by
        ``window_tree_mask``), keys past seq_len masked."""
        tree_mask = batch.tree_mask.to(torch.bool)
        bs, num_q, num_k = tree_mask.shape
        rel = key_pos[None, :] - (batch.seq_lens[:, None] - num_k)  # [bs, L], tree key index
        in_tree = (rel >= 0) & in_seq
        prefix = (rel < 0)[:, None, :]
        if window is not None:
            tree_mask, count = window_tree_mask(tree_mask, window)
            prefix = prefix & (rel[:, None, :] >= (count - window)[:, :, None])
        tree_bits = torch.gather(tree_mask, 2,
                                 rel.clamp(0, num_k - 1)[:, None, :].expand(bs, num_q, -1))
        return prefix | (in_tree[:, None, :] & tree_bits)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        if batch.batch_size == 0:
            return q.new_empty(0, self.num_heads, self.head_dim)
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        groups = self._groups_by_window[self.layer_window(layer_id)]
        if len(groups) == 1:
            return self.attend(q, layer_id, groups[0])
        out = q.new_empty(q.shape[0], self.num_heads, self.head_dim)
        for group in groups:
            out.index_copy_(0, group.tokens, self.attend(q.index_select(0, group.tokens),
                                                          layer_id, group))
        return out

    def attend(self, q: torch.Tensor, layer_id: int, group: _Group) -> torch.Tensor:
        """q: the group's token rows [tokens, H, D]; returns its output in the same order."""
        return self.attend_in(q, self.kv_pool.k_buffer[layer_id], self.kv_pool.v_buffer[layer_id],
                              group)

    def attend_in(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                  group: _Group) -> torch.Tensor:
        """`attend` on one layer's KV buffers given as tensors (the compiled decode step's
        layer takes them as inputs, gpu/compiled_decode.py)."""
        if group.ragged is not None:
            return self._attend_ragged(q, k_buffer, v_buffer, group.ragged)
        n, max_len = group.size, group.max_len
        # [n, L, kv_heads, D]
        keys = k_buffer.index_select(0, group.key_locs).to(q.dtype).view(
            n, max_len, self.num_kv_heads, self.head_dim)
        values = v_buffer.index_select(0, group.key_locs).to(q.dtype).view(
            n, max_len, self.num_kv_heads, self.head_dim)
        if group.decode and q.device.type == "cpu" and q.dtype == torch.float32:
            return self._decode_bmm(q, keys, values, group.decode_bias)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [n, kv_heads, L, D]
        if group.decode:
            queries = q[:, :, None, :]  # [n, H, 1, D]
        else:
            queries = q[group.query_index].transpose(1, 2)  # [n, H, Lq, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask,
                                             scale=self.scale, enable_gqa=True)
        if group.decode:
            return out[:, :, 0, :]
        return out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim).index_select(
            0, group.query_rows)

    def _attend_ragged(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                       requests: list[_Ragged]) -> torch.Tensor:
        out = torch.empty_like(q)
        for r in requests:
            # [1, kv_heads, seq_len, D] and [1, H, length, D]
            keys = k_buffer.index_select(0, r.key_locs).to(q.dtype).transpose(0, 1)[None]
            values = v_buffer.index_select(0, r.key_locs).to(q.dtype).transpose(0, 1)[None]
            queries = q[r.start:r.start + r.length].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=r.mask,
                                               is_causal=r.mask is None, scale=self.scale,
                                               enable_gqa=True)
            out[r.start:r.start + r.length] = o[0].transpose(0, 1)
        return out

    def _decode_bmm(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    bias: torch.Tensor) -> torch.Tensor:
        """q: [bs, H, D]; keys, values: [bs, L, kv_heads, D]; bias [bs, 1, L]: 0 inside the
        sequence, -inf in the padding. Returns [bs, H, D]."""
        bs, kv_heads, d = q.shape[0], self.num_kv_heads, self.head_dim
        q = q.view(bs, kv_heads, self.num_heads // kv_heads, d)
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
