"""Device-side KV storage: a paged token pool and the per-slot token-location table.

The scheduler decides which pages a request owns (pure bookkeeping); the worker only applies
those grants here. Location ``loc`` of a token is ``page * page_size + offset``; page 0 is
reserved padding so that a zero location never aliases a live token.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from gpu.device import host_to_device


def zeroed_buffer(shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU an anonymous memory mapping of its own, whose pages the kernel
    zeroes on first touch: the pool costs neither start-up time (memset of 1.5 GB took a second
    of a worker's restart) nor resident memory until its pages are used. (calloc gave that
    only when it mapped fresh memory; a large free block in the heap it clears by hand.)"""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # The array keeps the mapping alive, the tensor the array.
    raw = np.frombuffer(mmap.mmap(-1, nbytes), dtype=f"u{dtype.itemsize}").reshape(shape)
    return torch.from_numpy(raw).view(dtype)


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if page_size < 1 or num_pages < 2:
            raise ValueError(f"KV pool needs page_size >= 1 and at least 2 pages (got "
                             f"page_size={page_size}, num_pages={num_pages})")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        size = num_pages * page_size
        shape = (size, num_kv_heads, head_dim)
        self.k_buffer = [zeroed_buffer(shape, dtype, self.device) for _ in range(num_layers)]
        self.v_buffer = [zeroed_buffer(shape, dtype, self.device) for _ in range(num_layers)]

    def write(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, k, v)


def write_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """One layer's keys and values for the tokens at KV locations `loc`, in the pool's dtype."""
    k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))


class ReqToTokenPool:
    """``req_to_token[slot, pos]`` is the KV location of token ``pos`` of the request in ``slot``.

    Slot 0 is reserved padding. Rows are filled from page grants: a request that owns pages
    ``[p0, p1, ...]`` maps position ``i`` to ``p[i // page_size] * page_size + i % page_size``.
    """

    def __init__(self, num_slots: int, max_context_len: int, page_size: int,
                 device: torch.device | str) -> None:
        self.num_slots = num_slots
        self.max_context_len = max_context_len
        self.page_size = page_size
        self.req_to_token = torch.zeros(num_slots, max_context_len, dtype=torch.int32,
                                        device=device)
        self._offsets = torch.arange(page_size, dtype=torch.int32, device=device)

    def grant_pages(self, slot: int, first_page_index: int, pages: torch.Tensor) -> None:
        """Map the request's pages number ``first_page_index ..`` to the given page ids."""
        if slot <= 0 or slot >= self.num_slots:
            raise ValueError(f"request slot {slot} is outside 1..{self.num_slots - 1}")
        locs = (pages.to(torch.int32)[:, None] * self.page_size + self._offsets[None, :]).reshape(-1)
        start = first_page_index * self.page_size
        end = min(start + locs.numel(), self.max_context_len)
        self.req_to_token[slot, start:end] = locs[: end - start]

    def grant_all(self, grants: list[tuple[int, int, np.ndarray]]) -> None:
        """Several grants (slot, first_page_index, page ids on the host) in one scatter: the
        host works the locations out, one copy and one index_copy_ carry them over. On a GPU
        each grant_pages is a copy and four launches (~50 us of host time; ~2.5 grants a step
        at 32 streams), and the host is what bounds a step there (docs/benchmarks.md)."""
        if not grants:
            return
        rows, locs = [], []
        width, offsets = self.max_context_len, np.arange(self.page_size, dtype=np.int64)
        for slot, first_page_index, pages in grants:
            if slot <= 0 or slot >= self.num_slots:
                raise ValueError(f"request slot {slot} is outside 1..{self.num_slots - 1}")
            grant_locs = (pages.astype(np.int64)[:, None] * self.page_size + offsets).reshape(-1)
            start = first_page_index * self.page_size
            end = min(start + grant_locs.size, width)
            rows.append(np.arange(slot * width + start, slot * width + end, dtype=np.int64))
            locs.append(grant_locs[: max(end - start, 0)].astype(np.int32))
        device = self.req_to_token.device  # index_copy_: no host sync on CUDA (as KV writes)
        self.req_to_token.view(-1).index_copy_(0, host_to_device(np.concatenate(rows), device),
                                               host_to_device(np.concatenate(locs), device))

    def locations(self, slot: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[slot, start:end]
