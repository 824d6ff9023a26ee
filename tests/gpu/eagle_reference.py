"""Test-only reference for the EAGLE head: dense causal attention over a packed batch (the
paged backend's stand-in). A chain-shaped DraftTree is the product's own (gpu/eagle/tree.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.eagle.draft_head import AttentionFn


def dense_causal_attention(num_heads: int, num_kv_heads: int, scale: float,
                           seq_lens: list[int] | None = None) -> AttentionFn:
    """An ``attention`` callable over dense SDPA: causal within each sequence of a packed batch
    (``seq_lens`` summing to n), or causal over all n tokens when ``seq_lens`` is None. Serving
    passes the paged backend instead."""
    group = num_heads // num_kv_heads
    masks: dict[torch.device, torch.Tensor] = {}

    def mask_for(n: int, device: torch.device) -> torch.Tensor:
        if device not in masks:
            if sum(seq_lens) != n:
                raise ValueError(f"seq_lens {seq_lens} sum to {sum(seq_lens)}, not to the "
                                 f"{n} tokens given")
            seq = torch.repeat_interleave(torch.arange(len(seq_lens)),
                                          torch.tensor(seq_lens)).to(device)
            idx = torch.arange(n, device=device)
            masks[device] = (seq[:, None] == seq[None, :]) & (idx[:, None] >= idx[None, :])
        return masks[device]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, hd]
        if seq_lens is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_for(n, q.device),
                                               scale=scale)
        return o.transpose(0, 1)

    return attention


