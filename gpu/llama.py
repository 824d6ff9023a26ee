"""A Llama-family decoder over a paged KV cache.

The model holds weights only; everything per-forward (token locations, lengths) arrives in a
`ForwardBatch` and the attention backend reads and writes the KV pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionBackend
from gpu.forward_batch import ForwardBatch
from gpu.layers import RotaryEmbedding, apply_rope, rms_norm, swiglu
from gpu.model_config import ModelConfig


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed_tokens = w("embed_tokens")
        self.lm_head = w("lm_head") if "lm_head" in weights else self.embed_tokens
        self.final_norm = w("final_norm")
        self.layers = [
            {name: w(f"layers.{i}.{name}") for name in
             ("input_norm", "qkv_proj", "o_proj", "post_attn_norm", "gate_up_proj", "down_proj")}
            for i in range(config.num_layers)
        ]
        self.rope = RotaryEmbedding(config, device, dtype)

    def hidden_states(self, batch: ForwardBatch, attn: AttentionBackend,
                      capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the decoder; returns final-normed hidden states and those of `capture_layers`.

        The captured states are each layer's *input* residual stream, the layout EAGLE-3 heads use.
        """
        cfg = self.config
        eps = cfg.rms_norm_eps
        n = batch.num_tokens
        h = F.embedding(batch.input_ids, self.embed_tokens)
        cos, sin = self.rope.cos_sin(batch.positions)
        captured: list[torch.Tensor] = []
        for layer_id, p in enumerate(self.layers):
            if layer_id in capture_layers:
                captured.append(h)
            x = rms_norm(h, p["input_norm"], eps)
            qkv = F.linear(x, p["qkv_proj"])
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = apply_rope(q.view(n, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rope(k.view(n, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
            o = attn.forward(q, k, v, layer_id, batch)
            h = h + F.linear(o.reshape(n, cfg.q_size), p["o_proj"])
            x = rms_norm(h, p["post_attn_norm"], eps)
            h = h + F.linear(swiglu(F.linear(x, p["gate_up_proj"])), p["down_proj"])
        return rms_norm(h, self.final_norm, eps), captured

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()
