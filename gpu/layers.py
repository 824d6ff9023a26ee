"""The building blocks of a Llama decoder: RMSNorm, rotary embedding, SwiGLU.

Written as plain functions over tensors so the per-op overhead (what costs on a small CPU)
stays low: fused q/k/v and gate/up projections, one cos/sin gather per forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gpu.model_config import ModelConfig, RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 as transformers does; the cast back happens once, on the product.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    # Llama-3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, scaled).float()


class RotaryEmbedding:
    """Rotate-half RoPE with a cos/sin table precomputed for every position."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        t = torch.arange(config.max_context_len, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # [max_len, head_dim]: cos/sin duplicated over the two halves, as rotate-half wants.
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim]: broadcast over heads.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
