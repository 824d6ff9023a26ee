"""A linear layer that multiplies one row at a time, for `runtime.deterministic`.

A CPU GEMM's blocking, and so the order in which it sums a row's products, depends on how many
rows it multiplies (measured: fp32 `torch.mm` gives other bits for a row at M=1 than inside
M=2..200), and Q4Linear and the draft head's int8 linears switch kernels by the row count. Fed
rows of one, every projection runs one kernel with one reduction order, whatever else is in
the batch. A Module, so that it can replace a draft head's nn.Linear children.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class RowwiseLinear(nn.Module):
    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.inner = inner

    @property
    def weight(self) -> torch.Tensor | None:
        """The wrapped layer's dense weight (an EAGLE-1 head borrows the lm_head's)."""
        return getattr(self.inner, "weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            return self.inner(x)
        y = torch.cat([self.inner(row) for row in rows.split(1)])
        return y.view(*x.shape[:-1], y.shape[-1])
