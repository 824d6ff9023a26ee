"""Linear layers over compressed weights, and `make_linear`, which picks one per weight.

Decode at small batch reads every weight once per step, so bytes per weight set its speed.
Two opt-in modes (`RunnerConfig.weight_quant`), measured on a 2-core AVX2 EPYC (no AVX-512,
no AMX) with SmolLM2-135M:

- "fp16": weights stored as fp16 and multiplied by FBGEMM's fp16 GEMM (fp32 activations and
  accumulation). Half the bytes, 1.3-1.5x faster matmuls at batch 1 and 32, logits within a
  few hundredths of fp32. On a GPU: fp16 weights through F.linear.
- "int8": per-output-channel symmetric int8 weights, multiplied by
  `aten._weight_int8pack_mm` with bf16 activations on the CPU. A quarter of the bytes, but
  on AVX2 the kernel is bound by its int8->bf16 conversion: about fp32-speed at batch 1 and
  slower at batch 32; it pays on CPUs with AVX-512. It costs accuracy (a per-row scale cannot
  follow the 32-wide blocks of a Q4 GGUF): about 4% of top-1 choices change. Elsewhere the
  weight is dequantized on the fly for F.linear (correct, not fast: no int8 GPU kernel here).

Every layer object is a callable `y = layer(x)` with x: [rows, in_features]; y has x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.layers import DenseLinear

WEIGHT_QUANT_MODES = ("none", "int8", "fp16")


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: returns (q [out, in] int8, scale [out] fp32) with
    weight ~= q * scale[:, None] and |error| <= scale / 2 per element."""
    w = weight.float()
    # An all-zero row gets a tiny scale, so it stays exactly zero instead of dividing by 0.
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


class Int8Linear:
    """Weight-only int8 linear (see the module docstring for where it pays)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.qweight, self.scale = quantize_int8_per_channel(weight)
        self.on_cpu = weight.device.type == "cpu"
        self.scale_bf16 = self.scale.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight,
                                                   self.scale_bf16)
            return y.to(x.dtype)
        return F.linear(x, dequantize_int8(self.qweight, self.scale, x.dtype))


class Fp16Linear:
    """fp16 weights; fp32 activations and accumulation through FBGEMM on the CPU."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.on_cpu = weight.device.type == "cpu"
        if self.on_cpu:
            if "fbgemm" not in torch.backends.quantized.supported_engines:
                raise RuntimeError(
                    "weight_quant='fp16' on the CPU needs PyTorch built with FBGEMM (x86-64); "
                    "this build has none. Use weight_quant='none'.")
            # The packed form holds the fp16 copy; the fp32 original is not kept.
            self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)
        else:
            self.weight = weight.to(torch.float16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cpu:
            return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)
        return F.linear(x.to(torch.float16), self.weight).to(x.dtype)


Linear = DenseLinear | Int8Linear | Fp16Linear


def make_linear(weight: torch.Tensor, weight_quant: str = "none",
                both_layouts: bool = False, consume: bool = False) -> Linear:
    """The linear layer for `weight` [out, in] under `weight_quant` (`consume`: the caller
    gives the weight up, see DenseLinear)."""
    if weight_quant == "none":
        return DenseLinear(weight, both_layouts=both_layouts, consume=consume)
    if weight_quant == "int8":
        return Int8Linear(weight)
    if weight_quant == "fp16":
        return Fp16Linear(weight)
    raise ValueError(f"weight_quant '{weight_quant}' is unknown; choose one of "
                     f"{WEIGHT_QUANT_MODES}")
