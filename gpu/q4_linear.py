"""Small forwards on the GGUF's own 4-bit weights (CPU, bf16).

At batch 1 a CPU decode step streams every weight from memory once, so its matmuls cost what
their bytes cost: the dequantized bf16 copy of SmolLM2-135M's projections is 3.2x the file's
Q4_1 blocks (5 bits a weight with the block's scale and offset). torch's
CPU int4 matmul (`aten._weight_int4pack_mm_for_cpu`, group 32, `(q - 8) * scale + zero`) takes
those codes as they are. Measured on the 2-core AVX-512/AMX Xeon, the 30 layers' projections
with weights streamed from DRAM: 3.7 ms at 1 token against 23 ms in bf16, 6.3 ms at 4, 12 ms at
5-8 and 17 ms at 12; bf16 stays near 25 ms up to 32 tokens, where the int4 kernel takes 58. So a
projection keeps both forms and picks by the number of tokens in the forward (the limit,
`runtime.q4_max_tokens`, defaults to 12): the engine decodes one stream at 66 tok/s instead
of 31 (docs/benchmarks.md).

The int4 path multiplies with the file's exact weights (scale and zero rounded to bf16, the
kernel's input dtype); the bf16 path with each weight rounded to bf16. Outputs agree to bf16
precision, not bit for bit. With fp32 activations the kernel is a slow reference loop (25x
slower than bf16), so fp32 models never take this path.
"""

from __future__ import annotations

import torch

from gpu.loader.gguf_q4 import Q4_GROUP, Q4Blocks
from gpu.quantized_linear import Linear

# Forwards of up to this many tokens use the codes by default: above ~12 the bf16 matmul wins.
DEFAULT_Q4_MAX_TOKENS = 12


def q4_kernel_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu")


def q4_applies(device: torch.device, dtype: torch.dtype, max_tokens: int) -> bool:
    """Whether a model on `device` in `dtype` runs small forwards on 4-bit codes."""
    return (max_tokens > 0 and device.type == "cpu" and dtype == torch.bfloat16
            and q4_kernel_available())


def q4_shape_ok(blocks: Q4Blocks) -> bool:
    """The kernel packs outputs in tiles of 16 (and inputs in groups of 32)."""
    out_features, in_features = blocks.codes.shape
    return out_features % 16 == 0 and in_features % Q4_GROUP == 0


class Q4Linear:
    """A projection with two forms: the 4-bit codes for forwards of at most `max_tokens` rows,
    `dense` (any Linear) for larger ones."""

    def __init__(self, dense: Linear, blocks: Q4Blocks, max_tokens: int) -> None:
        self.dense = dense
        self.out_features, self.in_features = blocks.codes.shape
        self.max_tokens = max_tokens
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            blocks.codes.to(torch.int32).contiguous(), 1)
        # [in / 32, out, 2]: per group and output, (scale, zero).
        self.scales_and_zeros = torch.stack([blocks.scale.t(), blocks.zero.t()], dim=-1).to(
            torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_tokens or x.dtype != torch.bfloat16:
            return self.dense(x)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, Q4_GROUP,
                                                          self.scales_and_zeros)
