"""Small forwards on the GGUF's own 4-bit weights (CPU, bf16).

At batch 1 a CPU decode step streams every weight from memory once, so its matmuls cost what
their bytes cost: the dequantized bf16 copy of SmolLM2-135M's projections is 3.2x the file's
Q4_1 blocks (5 bits a weight with the block's scale and offset). torch's
CPU int4 matmul (`aten._weight_int4pack_mm_for_cpu`, group 32, `(q - 8) * scale + zero`) takes
those codes as they are. Measured on the 2-core AVX-512/AMX Xeon, the 30 layers' projections
with weights streamed from DRAM: 3.7 ms at 1 token against 23 ms in bf16, 6.3 ms at 4, 12 ms at
5-8 and 17 ms at 12; bf16 stays near 25 ms up to 32 tokens, where the int4 kernel takes 58. So a
projection keeps both forms and picks by the number of tokens in the forward (the limit,
`runtime.q4_max_tokens`, defaults to 12). The lm_head runs on its 4-bit parts up to 4 rows
(a Q8_0 lm_head as two int4 matmuls, see gpu/loader/gguf_q4.py). With both, the engine decodes
one stream at 78 tok/s instead of 32 (docs/benchmarks.md).

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
# The lm_head on its 4-bit parts (a Q8_0 one is two int4 matmuls) pays up to 4 rows: measured
# on the 49152x576 lm_head with weights from DRAM, 2.3 ms at 1 row and 3.9 ms at 4 against 4-5
# ms in bf16, and 5.1-6.2 ms at 5-8 rows, where bf16 stays at 4-5 ms.
LM_HEAD_Q4_MAX_TOKENS = 4


def q4_kernel_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu")


def q4_applies(device: torch.device, dtype: torch.dtype, max_tokens: int) -> bool:
    """Whether a model on `device` in `dtype` runs small forwards on 4-bit codes."""
    return (max_tokens > 0 and device.type == "cpu" and dtype == torch.bfloat16
            and q4_kernel_available())


def q4_shape_ok(blocks: Q4Blocks | list[Q4Blocks]) -> bool:
    """The kernel packs outputs in tiles of 16 (and inputs in groups of 32)."""
    parts = blocks if isinstance(blocks, list) else [blocks]
    return bool(parts) and all(p.codes.shape[0] % 16 == 0 and p.codes.shape[1] % Q4_GROUP == 0
                               for p in parts)


class Q4Linear:
    """A projection with two forms: 4-bit codes for forwards of at most `max_tokens` rows,
    `dense` (any Linear) for larger ones.

    `blocks` is one 4-bit weight, or several whose outputs add up to the weight's (a Q8_0
    lm_head as two, gpu/loader/gguf_q4.py). Several are added in fp32 and the result is fp32:
    a bf16 sum would round twice.
    """

    def __init__(self, dense: Linear, blocks: Q4Blocks | list[Q4Blocks], max_tokens: int) -> None:
        parts = blocks if isinstance(blocks, list) else [blocks]
        self.dense = dense
        self.out_features, self.in_features = parts[0].codes.shape
        self.max_tokens = max_tokens
        # Per part: the packed codes and [in / 32, out, 2] (scale, zero) per group and output.
        self.parts = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            b.codes.to(torch.int32).contiguous(), 1),
            torch.stack([b.scale.t(), b.zero.t()], dim=-1).to(torch.bfloat16).contiguous())
            for b in parts]

    @property
    def weight(self) -> torch.Tensor | None:
        """The dense weight (for callers that borrow it, e.g. an EAGLE-1 head's lm_head)."""
        return getattr(self.dense, "weight", None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows > self.max_tokens or x.dtype != torch.bfloat16:
            return self.dense(x)
        x = x.contiguous()
        if len(self.parts) == 1:
            return _int4_mm(x, *self.parts[0])
        out = _int4_mm(x, *self.parts[0]).float()
        for packed, scales_and_zeros in self.parts[1:]:
            out += _int4_mm(x, packed, scales_and_zeros)
        return out


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, Q4_GROUP, scales_and_zeros)
