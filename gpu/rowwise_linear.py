"""A linear layer that multiplies one row at a time, for `runtime.deterministic`.

A CPU GEMM's blocking, and so the order in which it sums a row's products, depends on how many
rows it multiplies (measured: fp32 `torch.mm` gives other bits for a row at M=1 than inside
M=2..200), and Q4Linear switches kernels by the row count. Fed rows of one, every projection
runs one kernel with one reduction order, whatever else is in the batch.
"""

from __future__ import annotations

from typing import Callable

import torch


class RowwiseLinear:
    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.inner = inner

    @property
    def weight(self) -> torch.Tensor | None:
        """The wrapped layer's dense weight (an EAGLE-1 head borrows the lm_head's)."""
        return getattr(self.inner, "weight", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self.inner(x)
        return torch.cat([self.inner(row) for row in x.split(1)])
