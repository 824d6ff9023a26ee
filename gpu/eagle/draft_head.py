"""EAGLE draft heads: one decoder layer predicting the target's next token from its hidden states.

Two layouts, with the tensor names public checkpoints use so people can bring their own heads:

- ``eagle3`` (SpecForge / SGLang ``LlamaForCausalLMEagle3``): the first step reads the
  concatenated outputs of three target layers, squeezed to H by ``fc``; later steps read the
  head's own pre-norm output. The attention input is ``[norm(embeds), norm(hidden)]`` (2H wide),
  and the head has its own final norm and a reduced-vocabulary ``lm_head`` with a ``d2t`` map.
- ``eagle`` (EAGLE-1, yuhuili/EAGLE): ``fc`` mixes ``[embeds, hidden]`` (2H -> H, with bias) into
  one Llama layer with no input norm; logits come from the target's own lm_head.

Attention is a callable, so the same head runs over the paged KV cache when serving and over
dense SDPA when training. The target's embedding and lm_head are borrowed (non-persistent
buffers): they are never trained and never saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpu.device import host_to_device
from gpu.eagle.head_linear import PanelLinear, SmallRowsInt8Linear
from gpu.layers import apply_rope, rms_norm
from gpu.rope_scaling import RopeScaling, rope_inv_freq
from gpu.rowwise_linear import RowwiseLinear

ALGORITHMS = ("eagle3", "eagle")

# q [n, nh, hd], k [n, nkv, hd], v [n, nkv, hd] -> [n, nh, hd]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DraftHeadError(ValueError):
    """A draft head (its config or its weights) cannot be used with this target.

    The message says what was wrong, in which file, and what to do about it.
    """


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """SGLang's default EAGLE-3 aux layers: (1, L/2-1, L-4), as layer *outputs*."""
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclass(frozen=True)
class DraftHeadConfig:
    algorithm: str  # "eagle3" or "eagle"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # eagle3: reduced (or full) vocabulary; eagle: == vocab_size
    aux_layer_ids: tuple[int, ...]  # eagle3: target layers whose output feeds fc; eagle: ()
    rope_scaling: RopeScaling | None = None
    # Some EAGLE-3 heads (config.json "norm_before_residual": true) take the residual after
    # hidden_norm instead of before it; SGLang reads the same flag.
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.algorithm not in ALGORITHMS:
            raise DraftHeadError(f"draft head algorithm '{self.algorithm}' is unknown; "
                                 f"choose one of {ALGORITHMS}")
        if self.num_heads % self.num_kv_heads:
            raise DraftHeadError(f"draft head has {self.num_heads} attention heads, not a "
                                 f"multiple of its {self.num_kv_heads} KV heads")
        if self.algorithm == "eagle":
            if self.aux_layer_ids:
                raise DraftHeadError("an EAGLE-1 head reads the target's last hidden state; "
                                     "it takes no aux layer ids")
            if self.draft_vocab_size != self.vocab_size:
                raise DraftHeadError(f"an EAGLE-1 head predicts over the full vocabulary, but "
                                     f"draft_vocab_size {self.draft_vocab_size} != vocab_size "
                                     f"{self.vocab_size}")
            return
        aux = self.aux_layer_ids
        if len(aux) < 2:
            # With one aux layer fc's input is H wide and could not be told from a later step's.
            raise DraftHeadError(f"an EAGLE-3 head needs at least two aux layers, got {aux}")
        if list(aux) != sorted(set(aux)):
            # The target captures states in layer order, one per layer: repeats or a different
            # order would feed fc a concatenation it was not trained on.
            raise DraftHeadError(f"EAGLE-3 aux layer ids {aux} must be distinct and ascending")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DraftHeadError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                                 f"1..vocab_size ({self.vocab_size})")

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Layers whose *input* residual LlamaModel.hidden_states captures: the output of the
        layer before, so aux layer i is captured at i + 1."""
        return tuple(i + 1 for i in self.aux_layer_ids)

    @property
    def input_hidden_size(self) -> int:
        """Width of the target hidden state the head takes at its first step."""
        if self.algorithm == "eagle3":
            return len(self.aux_layer_ids) * self.hidden_size
        return self.hidden_size


def _linear(in_features: int, out_features: int, bias: bool, device, dtype) -> nn.Linear:
    # Uninitialised: the weights are loaded or initialised afterwards, so the default
    # kaiming init over a large lm_head would be wasted time.
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias,
                                    device=device, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device, dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, cfg: DraftHeadConfig, in_features: int, device, dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = _linear(in_features, q_size, False, device, dtype)
        self.k_proj = _linear(in_features, kv_size, False, device, dtype)
        self.v_proj = _linear(in_features, kv_size, False, device, dtype)
        self.o_proj = _linear(q_size, cfg.hidden_size, False, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                attention: AttentionFn) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rope(self.q_proj(x).view(n, self.num_heads, self.head_dim), cos, signed_sin)
        k = apply_rope(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), cos, signed_sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        o = attention(q, k, v)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, cfg: DraftHeadConfig, device, dtype) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(h, inter, False, device, dtype)
        self.up_proj = _linear(h, inter, False, device, dtype)
        self.down_proj = _linear(inter, h, False, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    """A Llama layer; EAGLE-3's reads [embeds, hidden] (2H), EAGLE-1's has no input norm."""

    def __init__(self, cfg: DraftHeadConfig, eagle3: bool, input_norm: bool, device, dtype) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.eagle3 = eagle3
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps, device, dtype) if input_norm else None
        self.hidden_norm = RMSNorm(h, eps, device, dtype) if eagle3 else None
        self.self_attn = _Attention(cfg, 2 * h if eagle3 else h, device, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, device, dtype)
        self.mlp = _MLP(cfg, device, dtype)

    def forward(self, emb: torch.Tensor | None, hidden: torch.Tensor, cos: torch.Tensor,
                signed_sin: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        if self.eagle3:
            residual = hidden
            hidden = self.hidden_norm(hidden)
            if self.norm_before_residual:
                residual = hidden
            x = torch.cat([self.input_layernorm(emb), hidden], dim=-1)  # embeds first
        else:
            residual = hidden
            x = self.input_layernorm(hidden) if self.input_layernorm is not None else hidden
        h = residual + self.self_attn(x, cos, signed_sin, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    """An EAGLE-3 or EAGLE-1 draft head (trainable parameters; the target's tensors borrowed).

    ``own_embed``: the head has its own ``embed_tokens`` (saved, frozen by default as SpecForge
    does); otherwise it embeds with ``target_embed``. ``layer0_input_norm``: an EAGLE-1 checkpoint
    that carries ``layers.0.input_layernorm.weight``. ``target_lm_head`` None means the target
    ties its embeddings (EAGLE-1 then uses ``target_embed`` as its lm_head).
    """

    def __init__(self, config: DraftHeadConfig, target_embed: torch.Tensor | None,
                 target_lm_head: torch.Tensor | None, *, own_embed: bool = False,
                 layer0_input_norm: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None,
                 parallel_target: tuple[Callable, Callable] | None = None) -> None:
        """``parallel_target``: the target's (embed, lm_head) layers to go through instead of
        its tables, from the start (see borrow_parallel_target): no table is taken then."""
        super().__init__()
        if target_embed is None and not own_embed and parallel_target is None:
            raise DraftHeadError("a draft head without its own embed_tokens needs the target's "
                                 "embedding (target_embed is None)")
        if device is None:
            device = target_embed.device if target_embed is not None else "cpu"
        if dtype is None:
            dtype = target_embed.dtype if target_embed is not None else torch.float32
        cfg = self.config = config
        h = cfg.hidden_size
        self.eagle3 = cfg.algorithm == "eagle3"
        # Borrowed, never saved: they move with .to() but stay out of state_dict().
        self.register_buffer("target_embed", target_embed, persistent=False)
        self.register_buffer("target_lm_head", None if self.eagle3 else target_lm_head,
                             persistent=False)
        self.embed_tokens = None
        if own_embed:
            self.embed_tokens = torch.nn.utils.skip_init(nn.Embedding, cfg.vocab_size, h,
                                                         device=device, dtype=dtype)
            self.embed_tokens.weight.requires_grad_(False)
        if self.eagle3:
            self.fc = _linear(cfg.input_hidden_size, h, False, device, dtype)
            self.midlayer = _DecoderLayer(cfg, True, True, device, dtype)
            self.norm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
            self.lm_head = _linear(h, cfg.draft_vocab_size, False, device, dtype)
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device)
            t2d[:cfg.draft_vocab_size] = True
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64,
                                                    device=device))
            self.register_buffer("t2d", t2d)
        else:
            self.fc = _linear(2 * h, h, True, device, dtype)
            self.layers = nn.ModuleList([_DecoderLayer(cfg, False, layer0_input_norm, device,
                                                       dtype)])
            # Identity maps, kept so callers need not care which algorithm they hold.
            self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.int64,
                                                    device=device), persistent=False)
            self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool,
                                                   device=device), persistent=False)
        # Under tensor parallelism: the target's vocabulary-parallel layers (borrow_parallel_target).
        self._parallel_embed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._parallel_lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        if parallel_target is not None:
            self.borrow_parallel_target(*parallel_target)
        # inv_freq stays fp32 whatever dtype the module is cast to: one copy per device.
        self._inv_freq_cpu = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self._rope_scale = cfg.rope_scaling.cos_sin_scale() if cfg.rope_scaling else 1.0
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def borrow_parallel_target(self, embed: Callable[[torch.Tensor], torch.Tensor],
                               lm_head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The head embeds (and an EAGLE-1 head scores) through the target's own layers, and
        the borrowed tables are dropped. Under tensor parallelism the target's embedding and
        lm_head are split by vocabulary, and its parallel layers' collectives give every rank
        whole rows (the head's own weights stay whole on every rank); on an AVX2-only CPU the
        target keeps its tied table as Q8_0 codes only (gpu/llama.py), read through its lookup
        and lm_head."""
        self.target_embed = None
        self.target_lm_head = None
        self._parallel_embed, self._parallel_lm_head = embed, lm_head

    def use_int8_for_small_forwards(self, max_rows: int, fp32_codes: bool = False,
                                    codes_only: str | None = None) -> int:
        """Serve forwards of at most ``max_rows`` rows on int8 copies of every bias-free linear
        (on the CPU; see SmallRowsInt8Linear, and its `codes_only`). Returns how many linears
        it wrapped."""
        def int8(child: nn.Module) -> SmallRowsInt8Linear | None:
            if not isinstance(child, nn.Linear) or child.bias is not None or (
                    fp32_codes and child.in_features % 32):  # Q8_0 blocks of 32
                return None
            return SmallRowsInt8Linear(child, max_rows, fp32_codes, codes_only)

        return self._replace_linears(int8)

    def use_dense_panels(self) -> int:
        """Serve every fp32 linear on the dense C kernel (PanelLinear; an explicit fp32 engine
        on the CPU). Returns how many it wrapped (0 without the library)."""
        return self._replace_linears(lambda child: PanelLinear.wrap(child) if isinstance(
            child, nn.Linear) and child.weight.dtype == torch.float32 else None)

    def use_rowwise_linears(self) -> None:
        """Multiply one row at a time in every linear (runtime.deterministic, see
        gpu/rowwise_linear.py), after any int8 wrapping."""
        self._replace_linears(lambda child: RowwiseLinear(child) if isinstance(
            child, (nn.Linear, SmallRowsInt8Linear)) else None)

    def _replace_linears(self, replacement: Callable[[nn.Module], nn.Module | None]) -> int:
        """Each child module for which `replacement` gives one is replaced by it; returns how
        many were."""
        replaced = 0
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if (new := replacement(child)) is not None:
                    setattr(module, name, new)
                    replaced += 1
        return replaced

    @property
    def weight_dtype(self) -> torch.dtype:
        weight = self.fc.weight
        return torch.float32 if weight is None else weight.dtype  # codes only: an fp32 head

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, head_dim / 2] fp32 at each position, the scaling applied: the same
        arithmetic as RotaryEmbedding's table (fp32 products), for any position."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = host_to_device(self._inv_freq_cpu,
                                                                         positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv_freq  # [n, half]
        return freqs.cos() * self._rope_scale, freqs.sin() * self._rope_scale

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos / signed sin in apply_rope's layout, rounded to the model dtype after cos/sin."""
        cos, sin = self.rope_tables(positions)
        return cos.to(dtype)[:, None, None, :], torch.stack([-sin, sin], dim=1).to(dtype)[:, None]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [n, H] in the head's dtype (its own table or the target's)."""
        if self.embed_tokens is not None:
            emb = F.embedding(input_ids, self.embed_tokens.weight)
        elif self._parallel_embed is not None:
            emb = self._parallel_embed(input_ids)
        else:
            emb = F.embedding(input_ids, self.target_embed)
        return emb if emb.dtype == self.weight_dtype else emb.to(self.weight_dtype)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attention: AttentionFn) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over n tokens.

        Returns (hidden_out [n, H], pre-norm: fed back as the next step's ``hidden``;
        logits_hidden [n, H]: what ``logits`` takes; normed for eagle3, hidden_out for eagle).
        """
        dtype = self.weight_dtype
        emb = self.embed(input_ids)
        if hidden.dtype != dtype:
            hidden = hidden.to(dtype)
        cos, signed_sin = self._cos_sin(positions, dtype)
        if self.eagle3:
            if hidden.shape[-1] != self.config.hidden_size:
                hidden = self.fc(hidden)  # first step: the concatenated aux states
            out = self.midlayer(emb, hidden, cos, signed_sin, attention)
            return out, self.norm(out)
        x = self.fc(torch.cat([emb, hidden], dim=-1))
        out = self.layers[0](None, x, cos, signed_sin, attention)
        return out, out

    def logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        """[n, draft_vocab] float32 (eagle3: the head's lm_head; eagle: the target's)."""
        if self.eagle3:
            return self.lm_head(logits_hidden).float()
        if self._parallel_lm_head is not None:
            return self._parallel_lm_head(logits_hidden).float()
        weight = self.target_lm_head if self.target_lm_head is not None else self.target_embed
        return F.linear(logits_hidden.to(weight.dtype), weight).float()

    def greedy_ids(self, logits_hidden: torch.Tensor) -> torch.Tensor | None:
        """logits(logits_hidden).argmax(-1) in draft ids, the logits never written, where an
        EAGLE-3 head's lm_head runs on the C kernel's codes; else None."""
        head = self.lm_head if self.eagle3 else None
        return head.argmax(logits_hidden) if isinstance(head, SmallRowsInt8Linear) else None

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (target = draft + d2t[draft])."""
        return draft_ids + self.d2t[draft_ids]
