"""Projections kept in the GGUF's own quantized form (CPU, bf16): no full bf16 copy.

At batch 1 a CPU decode step streams every weight from memory once, so its matmuls cost what
their bytes cost: a bf16 copy of SmolLM2-135M's projections is 3.2x the file's Q4_1 blocks.
torch's CPU int4 matmul (`aten._weight_int4pack_mm_for_cpu`, group 32, `(q - 8) * scale +
zero`) takes a GGUF's Q4_0 / Q4_1 / Q4_K codes as they are, and Q5_K, Q6_K and Q8_0 as one
int4 matrix over a widened input (gpu/loader/gguf_q4.py, gpu/loader/gguf_kquants.py). Only
that packed form is resident; the file's weights are not copied to bf16.

Every forward of fewer than DEQUANTIZE_FROM_ROWS rows runs the int4 kernel. A larger one (a
long prefill chunk) dequantizes the weight a chunk of outputs at a time into a reused bf16
scratch buffer and multiplies with the dense kernel (gpu/int4_dequant.py). Measured on a
heavily contended 2-core AVX512-BF16 Xeon (no AMX), SmolLM2-135M's 120 projections: int4 kernel
14 ms at 1 row, 309 at 32 and 1,067 at 256; dequantize + bf16 1,120 at 32 and 4,593 at 256
(docs/benchmarks.md). So the scratch path is kept for very large forwards only, where the
dense kernel's better compute can pay for the dequantization; `runtime.q4_max_tokens` (0:
keep nothing quantized) still bounds the tied lm_head's forwards on its int4 parts.
The lm_head of a model that ties it to its embedding keeps the embedding's bf16 table (the
token lookup reads it anyway) for forwards above LM_HEAD_Q4_MAX_TOKENS rows.

Exactness: the codes are the file's; the kernel takes scales and zeros in bf16 only (fp32 or
fp16 ones are refused), so each represented weight is off the file's by at most
2^-9 (|q - 8| |scale| + |zero|) (bf16 rounds to 8 significant bits), of the order of a bf16
copy's own rounding (2^-9 |w|). With fp32 activations the kernel is a slow reference loop, so
fp32 models never take this path.
"""

from __future__ import annotations

import torch

from gpu.int4_dequant import dequantized_chunks_t, dequantized_matmul, pack_codes, packed_block
from gpu.loader.gguf_q4 import Q4_GROUP, Int4Weight
from gpu.quantized_linear import Linear

# Forwards of at least this many rows dequantize into scratch; smaller ones run the int4 kernel
# (measured above: the kernel 4.3x faster at 256 rows; the crossover is above that).
DEQUANTIZE_FROM_ROWS = 1024
# A tied lm_head runs on its 4-bit parts up to 4 rows and on the embedding's bf16 table above:
# measured on the 49152x576 lm_head with weights from DRAM, 2.3 ms at 1 row and 3.9 ms at 4
# against 4-5 ms in bf16, and 5.1-6.2 ms at 5-8 rows, where bf16 stays at 4-5 ms.
LM_HEAD_Q4_MAX_TOKENS = 4


def q4_kernel_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu")


def q4_applies(device: torch.device, dtype: torch.dtype, max_tokens: int) -> bool:
    """Whether a model on `device` in `dtype` keeps a GGUF's quantized projections as they are."""
    return (max_tokens > 0 and device.type == "cpu" and dtype == torch.bfloat16
            and q4_kernel_available())


def q4_shape_ok(weights: Int4Weight | list[Int4Weight]) -> bool:
    parts = weights if isinstance(weights, list) else [weights]
    return bool(parts) and all(w.kernel_shape_ok() for w in parts)


class Q4Linear:
    """A projection on packed int4 weights: `segments` are row ranges of the output (a fused
    q/k/v whose v is stored as another type), each one Int4Weight.

    `dense` (any Linear, optional) takes forwards above `max_tokens` rows instead of the
    scratch dequantization: a tied lm_head's embedding table, which stays resident anyway, or
    on a CPU without native bf16 an FBGEMM fp16 pack (gpu/cpu_kernels.py). `fp32_input`: the
    model runs in fp32 and its small forwards still take the codes (rounding the input to
    bf16); otherwise a non-bf16 input always goes to `dense`.
    """

    def __init__(self, segments: Int4Weight | list[Int4Weight], max_tokens: int,
                 dense: Linear | None = None, fp32_input: bool = False) -> None:
        weights = segments if isinstance(segments, list) else [segments]
        self.segments = [w.shape for w in weights]
        self.in_features = self.segments[0].in_features
        self.out_features = sum(s.out_features for s in self.segments)
        self.max_tokens = max_tokens
        self.dense = dense
        self.fp32_input = fp32_input
        self.keep_codes(weights)

    def keep_codes(self, weights: list[Int4Weight]) -> None:
        """The codes are packed for the kernel and dropped: only the kernel's form stays."""
        self.dequantize_from = DEQUANTIZE_FROM_ROWS
        self.block = packed_block()
        # Per segment: the packed codes and [width / 32, out, 2] (scale, zero) in bf16.
        self.packed = [(pack_codes(w.blocks.codes),
                        torch.stack([w.blocks.scale.t(), w.blocks.zero.t()], dim=-1)
                        .to(torch.bfloat16).contiguous()) for w in weights]

    @property
    def weight(self) -> torch.Tensor:
        """A bf16 [out, in] weight (for callers that borrow it, e.g. an EAGLE-1 head's lm_head):
        the dense one, or a fresh dequantized copy that the caller then owns."""
        if getattr(self.dense, "weight", None) is not None:  # an fp16 pack has none
            return self.dense.weight
        return torch.cat([self.dequantized_t(i).t() for i in range(len(self.segments))])

    def dequantized_t(self, segment: int) -> torch.Tensor:
        """Segment `segment`'s weights as the kernel multiplies them, bf16 W^T [in, out]."""
        shape, (packed, scales_and_zeros) = self.segments[segment], self.packed[segment]
        if self.block is None:  # an unknown packed layout: the kernel itself, on the identity
            eye = torch.eye(shape.in_features, dtype=torch.bfloat16)
            return _int4_mm(shape.widen(eye), packed, scales_and_zeros)
        return torch.cat([w_t.clone() for _, w_t in dequantized_chunks_t(
            shape, packed, scales_and_zeros, self.block)], dim=1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.dense is not None and (rows > self.max_tokens or (
                x.dtype != torch.bfloat16 and not self.fp32_input)):
            return self.dense(x)
        small = rows <= self.max_tokens or rows < self.dequantize_from or self.block is None
        xb = x.to(torch.bfloat16).contiguous()
        outs = [_int4_mm(w.widen(xb), *p) if small else dequantized_matmul(xb, w, *p, self.block)
                for w, p in zip(self.segments, self.packed)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y.to(x.dtype)


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.ops.fmserve.int4pack_mm(x, packed, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, Q4_GROUP, scales_and_zeros)


# The int4 matmul as one opaque op for torch.compile (the compiled decode step): inductor's
# own lowering of the aten op makes the group size a graph constant, which inside a nested
# compile region (the step's one traced layer) reaches the kernel as a tensor it refuses
# ("group size must be a scalar", torch 2.13). The op runs the same aten kernel.
_OPS = torch.library.Library("fmserve", "FRAGMENT")
_OPS.define("int4pack_mm(Tensor x, Tensor packed, Tensor scales_and_zeros) -> Tensor")
_OPS.impl("int4pack_mm", lambda x, packed, scales_and_zeros: torch.ops.aten.
          _weight_int4pack_mm_for_cpu(x, packed, Q4_GROUP, scales_and_zeros), "CPU")


@torch.library.register_fake("fmserve::int4pack_mm")
def _(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], scales_and_zeros.shape[1])
