"""The architecture facts a decoder needs, whatever file they came from. The families differ
only in the flags below (gpu/loader/families.py says which family sets which)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu.rope_scaling import RopeScaling


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # the family (gpu/loader/families.py): "llama", "mistral", "qwen2", ...
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_context_len: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    sliding_window: int | None = None  # a query sees only its last `window` keys (Mistral)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
