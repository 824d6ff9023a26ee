"""The draft head's linears on the CPU: int8 copies for its few-row forwards (a draft step at
batch 1 multiplies one row by each weight, and there the bytes read are the cost), or for an
explicit fp32 engine the dense C kernel's panels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu_q4_kernel import Q8Rows, q8_matmul, q8_matmul_argmax, scratch_matmul
from gpu.dense_fp32 import pack_panels, panel_matmul
from gpu.quantized_linear import quantize_int8_per_channel


class SmallRowsInt8Linear(nn.Module):
    """An nn.Linear (no bias) that also keeps its weight as int8, for forwards of at most
    ``max_rows`` rows on the CPU: in bf16 per-output-channel int8 (``aten._weight_int8pack_mm``),
    in fp32 (``fp32_codes``, a CPU without native bf16) Q8_0 blocks on fmserve's C kernel
    (gpu/cpu_q4_kernel.py), as the target's lm_head there.

    A draft step at batch 1 multiplies one row by each of the head's weights, and on the CPU that
    costs what reading the weight costs: int8 halves the bytes (quarters them against fp32). The
    draft only proposes tokens (the target verifies them), so its rounding can change the accept
    length, never the output. Same state_dict as the nn.Linear it wraps."""

    def __init__(self, linear: nn.Linear, max_rows: int, fp32_codes: bool = False,
                 codes_only: str | None = None) -> None:
        """`codes_only` ("fp32" or "bf16", with `fp32_codes`): keep no fp32 weight; wider
        forwards multiply the codes dequantized a piece at a time (`scratch_matmul`, its GEMM
        in that dtype), as the target's projections do. Serving only: no state_dict then."""
        super().__init__()
        if linear.bias is not None:
            raise ValueError("SmallRowsInt8Linear wraps linears without a bias")
        self.weight = linear.weight
        self.max_rows = max_rows
        self.q8 = None
        self.codes_only = None
        if fp32_codes:
            self.q8 = Q8Rows.quantize(linear.weight)
            if codes_only is not None:
                self.codes_only = codes_only
                self.weight = None  # freed: ~40 MB of fp32 for the default model's head
            return
        q, scale = quantize_int8_per_channel(linear.weight.detach())
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("qscale", scale.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.codes_only is not None and rows.shape[0] > self.max_rows:
            y = scratch_matmul(rows.float().contiguous(), self.q8, self.codes_only == "bf16")
            return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        if rows.shape[0] > self.max_rows or x.device.type != "cpu":
            return F.linear(x, self.weight)
        if self.q8 is not None and x.dtype == torch.float32:
            y = q8_matmul(rows, self.q8)
        elif self.q8 is None and x.dtype == torch.bfloat16:
            y = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.qweight, self.qscale)
        else:
            return F.linear(x, self.weight)
        return y.view(*x.shape[:-1], y.shape[-1])

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """forward(x).argmax(-1) without writing the product, where the forward would run on
        the C kernel's codes (fp32 rows, at most max_rows); else None."""
        if (self.q8 is None or x.dtype != torch.float32 or x.device.type != "cpu"
                or x.shape[0] > self.max_rows):
            return None
        return q8_matmul_argmax(x, self.q8)


class PanelLinear(nn.Module):
    """An fp32 nn.Linear served on the dense C kernel (gpu/dense_fp32.py): its weight packed
    as panels, the only copy kept (serving only: no state_dict), its bias added after. Each
    row's result is independent of its batch, so deterministic mode leaves it unwrapped."""

    def __init__(self, linear: nn.Linear, panels: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.panels = panels
        self.bias = linear.bias
        self.weight = None

    @classmethod
    def wrap(cls, linear: nn.Linear) -> "PanelLinear | None":
        """The panel form of an fp32 CPU linear; None where the library is not built."""
        panels = pack_panels(linear.weight.detach())
        return None if panels is None else cls(linear, panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = panel_matmul(x.reshape(-1, x.shape[-1]), self.panels, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)
