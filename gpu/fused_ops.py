"""The decoder's elementwise work as three Triton kernels, for CUDA devices.

A decode step of a small model is made of many tiny kernels: per layer, a residual add and an
RMSNorm (norm, then the weight's multiply) twice, RoPE (multiply, flip, fused multiply-add)
and SwiGLU (SiLU, then multiply). On an H100 each such kernel costs ~2.3 us whatever its size,
and a decode CUDA graph's launch grows with its nodes; these kernels do each group in one:

- `add_rms_norm`: h += residual (in place, rounded in h's dtype), then weight * RMSNorm(h);
- `rope`: rotate-half RoPE of q and k together, reading cos/sin by position from the tables;
- `silu_mul`: SiLU(gate) * up from the fused gate_up projection.

Each rounds where the torch ops of gpu/layers.py round (the SiLU to the dtype before the
multiply, the norm before the weight), so they agree with them to the last bit but for the
order of the norm's sum of squares and the GPU's own exp/rsqrt (tests/gpu/test_fused_ops.py
checks this under TRITON_INTERPRET=1 on the CPU). The CPU paths never import this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(h_ptr, r_ptr, w_ptr, out_ptr, stride_h, stride_r, stride_out, n_cols,
                         eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty)  # F.rms_norm rounds here, then the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols,
             (w * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, n_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < n_heads
    src = x_ptr + t * stride_xt + heads * stride_xh + dims
    x0 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + pos * HALF + dims).to(tl.float32)
    neg_sin = tl.load(sin_ptr + pos * 2 * HALF + dims).to(tl.float32)
    pos_sin = tl.load(sin_ptr + pos * 2 * HALF + HALF + dims).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # apply_rope's rounding: (x * cos) in the dtype, then + flip(x) * signed_sin in fp32
    out0 = ((x0 * cos).to(dt).to(tl.float32) + x1 * neg_sin).to(dt)
    out1 = ((x1 * cos).to(dt).to(tl.float32) + x0 * pos_sin).to(dt)
    dst = out_ptr + t * n_heads * 2 * HALF + heads * 2 * HALF + dims
    tl.store(dst, out0, mask=mask)
    tl.store(dst + HALF, out1, mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dt)  # F.silu rounds before the multiply
    tl.store(out_ptr + row * n_cols + cols, (silu.to(tl.float32) * up).to(dt), mask=mask)


def add_rms_norm(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """h += residual (in place; none: h as it is), then weight * RMSNorm(h), as
    `h.add_(residual); rms_norm(h, weight, eps)` of gpu/layers.py for a weight in h's dtype."""
    n, cols = h.shape
    out = torch.empty_like(h)
    if n:
        r = h if residual is None else residual
        _add_rms_norm_kernel[(n,)](h, r, weight, out, h.stride(0), r.stride(0), out.stride(0),
                                   cols, eps, HAS_RESIDUAL=residual is not None,
                                   BLOCK=triton.next_power_of_2(cols), num_warps=4)
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         signed_sin: torch.Tensor) -> torch.Tensor:
    """gpu/layers.apply_rope of x [tokens, heads, head_dim] (a view with unit stride inside a
    head) at `positions`, reading the RotaryEmbedding's tables: a new contiguous tensor."""
    n, heads, head_dim = x.shape
    out = torch.empty((n, heads, head_dim), dtype=x.dtype, device=x.device)
    if n:
        _rope_kernel[(n,)](x, out, positions, cos, signed_sin, x.stride(0), x.stride(1), heads,
                           HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(heads),
                           num_warps=1)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gpu/layers.swiglu: SiLU of the first half of each row times its second half."""
    n, width = gate_up.shape
    cols = width // 2
    out = torch.empty((n, cols), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = min(1024, triton.next_power_of_2(cols))
        _silu_mul_kernel[(n, triton.cdiv(cols, block))](gate_up, out, gate_up.stride(0), cols,
                                                        BLOCK=block, num_warps=4)
    return out


def rope_applies(head_dim: int, cos: torch.Tensor) -> bool:
    """The rope kernel takes a power-of-two half head and the tables in their usual layout."""
    half = head_dim // 2
    return half & (half - 1) == 0 and cos.is_contiguous() and cos.shape[-1] == half
