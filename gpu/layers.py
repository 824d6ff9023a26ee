"""The building blocks of a Llama decoder: RMSNorm, rotary embedding, gated MLP activations
(SwiGLU, Gemma's GELU-tanh), dense linear.

Written as plain functions over tensors so the per-op overhead (what costs on a small CPU)
stays low: fused q/k/v and gate/up projections, rope applied to q and k in one call, one cos/sin
gather per forward, no dtype round trips when the model already runs in fp32.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from gpu.dense_fp32 import pack_panels, panel_matmul
from gpu.loader.fp32_convert import transposed_fp32
from gpu.rope_scaling import RopeScaling, rope_inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32 as transformers does. A weight in x's dtype scales after the cast back
    (Llama's order); an fp32 weight in a bf16/fp16 model (Gemma's 1 + w) scales before it.
    F.rms_norm computes in fp32 and rounds once for any input dtype, so each form is one norm
    kernel plus at most a cast and a multiply, not the seven kernels of the spelled-out
    arithmetic (on a GPU's decode graph that was ~430 of a token's ~900 kernels); it gives
    the spelled-out result bit for bit on the CPU, within two units in the last place on CUDA
    (tests/gpu/test_layers.py)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    if weight.dtype == torch.float32:
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
    return weight * F.rms_norm(x, weight.shape, None, eps)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every head of x [tokens, heads, head_dim] with its own row of weight
    [heads, head_dim] (Qwen3's q and k norms, side by side as q and k sit in the projection)."""
    head_dim = (x.shape[-1],)
    if weight.dtype == torch.float32:
        return (F.rms_norm(x.float(), head_dim, None, eps) * weight).to(x.dtype)
    return weight * F.rms_norm(x, head_dim, None, eps)


class RotaryEmbedding:
    """Rotate-half RoPE with cos/sin precomputed for every position.

    rotate_half(x) * sin equals flip(x viewed as [.., 2, half]) * [-sin, +sin], so a head is
    rotated with one flip and one fused multiply-add, and no concatenation.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None, max_len: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_len, half]
        self.half = head_dim // 2
        scale = scaling.cos_sin_scale() if scaling else 1.0
        # Rounded to the model dtype after cos/sin in fp32, as transformers does.
        self.cos = (freqs.cos() * scale).to(device=device, dtype=dtype)  # [max_len, half]
        sin = freqs.sin() * scale
        self.signed_sin = torch.stack([-sin, sin], dim=1).to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, 1, half] cos and [num_tokens, 1, 2, half] signed sin: they broadcast
        over heads (and cos over the two halves) in `apply_rope`."""
        return self.cos[positions][:, None, None, :], self.signed_sin[positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] (may be a strided view); returns a new contiguous tensor."""
    n, heads, head_dim = x.shape
    halves = x.view(n, heads, 2, head_dim // 2)
    return torch.addcmul(halves * cos, halves.flip(2), signed_sin).view(n, heads, head_dim)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_glu(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP: transformers' gelu_pytorch_tanh of the gate, times up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


GATED_ACTIVATIONS = {"silu": swiglu, "gelu_tanh": gelu_tanh_glu}  # ModelConfig.mlp_activation


def fused_ops_for(device: torch.device) -> ModuleType | None:
    """gpu/fused_ops (Triton kernels for the elementwise groups) on a CUDA device; None on a
    CPU, whose decoders never import Triton (or where it is missing)."""
    if device.type != "cuda":
        return None
    try:
        from gpu import fused_ops
    except ImportError:
        return None
    return fused_ops


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """weight.t().contiguous(): in C in one pass where the library is built (an fp32 CPU
    weight), else in pieces."""
    fast = transposed_fp32(weight)
    return fast if fast is not None else transposed_in_pieces(weight)


def transposed_in_pieces(weight: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """weight.t().contiguous(), copied `rows` rows at a time: each piece's reads stay in
    cache. torch's one copy of the transposed view ran at 0.3-0.9 GB/s on a 2-core EPYC (the
    default model's fp32 gate_up 19 -> 2.2 ms, its lm_head 108 -> 72 ms; every DenseLinear of
    an fp32 engine's load 0.36 -> 0.25 s)."""
    out = torch.empty(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device)
    for start in range(0, weight.shape[0], rows):
        out[:, start:start + rows].copy_(weight[start:start + rows].t())
    return out


class DenseLinear:
    """y = x @ W^T with W kept in the layout this device multiplies fastest.

    On CPU in fp32 with the C library built: W packed as panels of 16 output columns for the
    C kernel (gpu/dense_fp32.py; on one thread of an AVX2 EPYC 1.3-2.3x torch.mm at 1-8 rows,
    1.2-1.5x at 16-64), the only copy kept. Without the library, MKL (measured on an AVX2 EPYC, weights
    streamed from DRAM): a one-row product reads W^T [in, out] about 1.6x faster than W
    [out, in] when out >= in, and 2x faster for the 49152-wide lm_head; narrow outputs
    (down_proj) are faster the usual way; a [out, in] weight runs its few-row products faster
    as W @ x^T. Elsewhere (GPU, bf16) F.linear is the right call.

    `both_layouts` keeps W [out, in] too (the lm_head, which an EAGLE-1 head borrows).
    `consume`: the caller gives W up, and the panels may take its place (gpu/dense_fp32.py).
    x is [rows, in_features].
    """

    def __init__(self, weight: torch.Tensor, both_layouts: bool = False,
                 consume: bool = False) -> None:
        self.out_features, self.in_features = weight.shape
        self.cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        wide = self.out_features >= self.in_features
        self.weight = weight  # [out, in]; None when only another layout is kept
        self.weight_t = None  # [in, out]
        self.panels = (pack_panels(weight, in_place=consume and not both_layouts)
                       if self.cpu_fp32 else None)
        if self.panels is None and self.cpu_fp32 and (wide or both_layouts):
            self.weight_t = transposed(weight)
        if (self.panels is not None or self.weight_t is not None) and not both_layouts:
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return panel_matmul(x, self.panels, self.out_features)
        if self.weight_t is not None and (self.weight is None or x.shape[0] == 1):
            return torch.mm(x, self.weight_t)
        if self.cpu_fp32 and x.shape[0] > 1:
            return torch.mm(self.weight, x.t()).t()
        return F.linear(x, self.weight)
