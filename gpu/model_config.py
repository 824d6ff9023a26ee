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
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
    sliding_window: int | None = None  # a query sees only its last `window` keys (Mistral)
    # The layers the window applies to (Gemma 3's local layers); None: every layer.
    window_layers: tuple[int, ...] | None = None
    # RoPE base of the windowed layers, which then rotate without rope_scaling (Gemma 3's
    # rope_local_base_freq); None: every layer rotates alike.
    local_rope_theta: float | None = None
    # Gemma 3 (each None/False/"silu" elsewhere):
    mlp_activation: str = "silu"  # the gate's activation in act(gate) * up
    norm_adds_one: bool = False  # an RMSNorm scales by (1 + w), w as stored
    sandwich_norms: bool = False  # RMSNorms on the attention and MLP outputs too
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # scores scaled by this ** -0.5 (else head_dim)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id` (None: it attends to every key)."""
        if self.window_layers is not None and layer_id not in self.window_layers:
            return None
        return self.sliding_window
