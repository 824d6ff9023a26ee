"""Linear layers over quantized weights (placeholder: filled in below)."""
from __future__ import annotations
import torch
from gpu.layers import DenseLinear
WEIGHT_QUANT_MODES = ("none",)
def make_linear(weight: torch.Tensor, weight_quant: str = "none", both_layouts: bool = False):
    return DenseLinear(weight, both_layouts=both_layouts)
