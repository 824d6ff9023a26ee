"""The layers of a tensor-parallel model that communicate (gpu/tensor_parallel.py says which
part each rank holds). Each wraps the rank's local layer and keeps it as `inner`, so
`gpu.llama.unwrap` still finds the projection underneath.

Collectives go through torch.distributed on the default group (gloo on the CPU, NCCL on CUDA)
and are enqueued like any other op: on a GPU they run on the current stream, so nothing here
makes the host wait.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class RowParallel:
    """A projection whose input is this rank's slice of the features: its output is a partial
    sum, all-reduced into the full one (o_proj, down_proj)."""

    def __init__(self, inner, group: dist.ProcessGroup | None = None) -> None:
        self.inner = inner
        self.group = group
        self.in_features = getattr(inner, "in_features", None)
        self.out_features = getattr(inner, "out_features", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x).contiguous()  # a collective needs a dense tensor (mm may transpose)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding:
    """This rank's rows [start, start + rows) of the embedding table: an id outside them gives
    zeros, and the all-reduce sums the one rank that holds it with the zeros of the others
    (exact)."""

    def __init__(self, table: torch.Tensor, start: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.table = table
        self.start = start
        self.group = group

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.shape[0]
        local = ids - self.start
        outside = (local < 0) | (local >= rows)
        h = F.embedding(local.clamp(0, rows - 1), self.table)
        h.masked_fill_(outside[:, None], 0)
        dist.all_reduce(h, group=self.group)
        return h


class VocabParallelHead:
    """This rank's rows of the lm_head: its logits are all-gathered, so every rank has the
    full [rows, vocab] logits (and samples the same tokens). Every rank's share is
    `shard_rows` wide; the last rank's, narrower where the vocabulary does not divide, is
    padded and the padding cut off after the gather."""

    def __init__(self, inner, vocab_size: int, shard_rows: int, world_size: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.inner = inner
        self.vocab_size = vocab_size
        self.shard_rows = shard_rows
        self.world_size = world_size
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if y.shape[1] < self.shard_rows:
            y = F.pad(y, (0, self.shard_rows - y.shape[1]))
        y = y.contiguous()
        parts = [torch.empty_like(y) for _ in range(self.world_size)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=1)[:, :self.vocab_size]
