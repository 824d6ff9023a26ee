"""A Llama-family decoder over a paged KV cache: Llama 1/2/3.x, Mistral, Qwen2/2.5, Qwen3 and
Gemma 3.

The families are one decoder: Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm of q and k
before rope, Mistral a sliding window (the attention backend's, see gpu/attention/base.py).
Gemma 3 adds to Qwen3's q/k norm: (1 + w) RMSNorms (kept in fp32: 1 + w would round in bf16),
norms on the attention and MLP outputs, a GELU-tanh gate, embeddings scaled by sqrt(hidden),
and windowed layers with their own RoPE base between full ones. The config's flags say which
(gpu/model_config.py, gpu/loader/families.py).

The model holds weights only; everything per-forward (token locations, lengths) arrives in a
`ForwardBatch` and the attention backend reads and writes the KV pool. Projections are linear
layer objects from `make_linear`: dense in the model dtype, or compressed (`weight_quant`);
on a bf16 CPU model a GGUF's quantized projections and lm_head (Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K)
stay in that form, with no dense copy, as `Q4Linear`s on torch's int4 kernel
(`q4_max_tokens`, gpu/q4_linear.py); a tied lm_head uses its embedding's table above 4 rows. `deterministic` wraps every projection in a RowwiseLinear
(gpu/rowwise_linear.py), so a row's result does not depend on its batch, except a dense fp32
one on the C kernel, which sums each row alone (gpu/dense_fp32.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from gpu import cpu_sampling
from gpu.attention.base import AttentionBackend
from gpu.cpu_kernels import Fp32Split
from gpu.cpu_q4_kernel import (CodesLinear, Q8Rows, available as codes_kernel_available,
                               codes_linear_ok, q8_lookup, q8_matmul, q8_matmul_argmax)
from gpu.forward_batch import ForwardBatch
from gpu.layers import (GATED_ACTIVATIONS, RotaryEmbedding, apply_rope, fused_ops_for,
                        head_rms_norm, rms_norm, swiglu)
from gpu.loader.gguf_q4 import Int4Weight
from gpu.model_config import ModelConfig
from gpu.q4_linear import LM_HEAD_Q4_MAX_TOKENS, Q4Linear, q4_applies, q4_shape_ok
from gpu.quantized_linear import WEIGHT_QUANT_MODES, Fp16Linear, Linear, make_linear
from gpu.rowwise_linear import RowwiseLinear


Projection = Linear | Q4Linear | RowwiseLinear


def unwrap(proj: Projection) -> Linear | Q4Linear:
    """The projection under its wrappers (RowwiseLinear, tensor parallelism's layers)."""
    while hasattr(proj, "inner"):
        proj = proj.inner
    return proj


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    qkv_proj: Projection
    o_proj: Projection
    post_attn_norm: torch.Tensor
    gate_up_proj: Projection
    down_proj: Projection
    qkv_bias: torch.Tensor | None = None  # [q_size + 2 * kv_size]
    qk_norm: torch.Tensor | None = None  # [num_heads + num_kv_heads, head_dim]
    attn_out_norm: torch.Tensor | None = None  # sandwich_norms: on o_proj's output
    mlp_out_norm: torch.Tensor | None = None  # sandwich_norms: on down_proj's output


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, weight_quant: str = "none",
                 q4: dict[str, list[Int4Weight]] | None = None, q4_max_tokens: int = 0,
                 lm_head_q4: Int4Weight | None = None, deterministic: bool = False,
                 fp32_split: Fp32Split | None = None, max_positions: int | None = None,
                 consume_weights: bool = False) -> None:
        if weight_quant not in WEIGHT_QUANT_MODES:
            raise ValueError(f"weight_quant '{weight_quant}' is unknown; choose one of "
                             f"{WEIGHT_QUANT_MODES}")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.weight_quant = weight_quant
        self._logits_buffer: torch.Tensor | None = None  # logits(reuse=True)

        q4 = q4 or {}

        def w(name: str) -> torch.Tensor:
            # A weight the loader kept as int4 only, where this model cannot use that form.
            weight = weights[name] if name in weights else torch.cat(
                [part.dequantize() for part in q4[name]])
            return weight.to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor | None:
            if name not in weights:
                return None
            if config.norm_adds_one:  # 1 + w in fp32, as transformers computes it
                return (weights[name].to(device=device, dtype=torch.float32) + 1).contiguous()
            return w(name)

        # The file's quantized weights as they are, where it has them (gpu/q4_linear.py).
        # An fp32 model on a CPU without native bf16 (`fp32_split`, gpu/cpu_kernels.py) keeps
        # them too, as codes only: wider forwards dequantize a piece at a time into scratch.
        use_q4 = weight_quant == "none" and (fp32_split is not None
                                             or q4_applies(device, dtype, q4_max_tokens))
        self.q4_projections = 0
        # Projections whose wider forwards (fp32_split) take a path torch.compile cannot trace
        # (the scratch dequantization's C calls, FBGEMM's packed weights).
        self.wide_paths = 0
        # The most rows a decoder forward takes without reaching such a path (None: none):
        # the compiled decode step's largest batch (gpu/compiled_decode.py).
        self.kernel_max_rows: int | None = None

        def quantized(parts: Int4Weight | list[Int4Weight], dense: Callable[[], torch.Tensor],
                      rows: int, split_rows: int) -> Q4Linear | Fp16Linear:
            if fp32_split is None:
                return Q4Linear(parts, rows)
            self.wide_paths += 1
            if codes_linear_ok(parts):  # fmserve's C kernel, scratch dequant above split_rows
                return CodesLinear(parts, split_rows, fp32_split.bf16_gemm)
            fp16 = Fp16Linear(dense())  # Q6_K's digits16 parts: torch's int4 kernel + FBGEMM
            return Q4Linear(parts, split_rows, dense=fp16, fp32_input=True) if split_rows else fp16

        def linear(name: str) -> Projection:
            if not use_q4 or name not in q4 or not q4_shape_ok(q4[name]):
                weight = w(name)
                # `consume_weights`: the caller's dict gives the weight up (its memory may
                # become the dense kernel's panels), so it leaves the dict
                mine = consume_weights and weights.get(name) is weight
                if mine:
                    del weights[name]
                return rowwise(make_linear(weight, weight_quant, consume=mine))
            self.q4_projections += 1
            split_rows = fp32_split.projection_rows if fp32_split else 0
            if fp32_split:
                self.kernel_max_rows = min(split_rows, self.kernel_max_rows if
                                           self.kernel_max_rows is not None else split_rows)
            return rowwise(quantized(q4[name], partial(w, name), q4_max_tokens, split_rows))

        def rowwise(layer: Linear | Q4Linear) -> Projection:
            # the dense fp32 C kernel sums each row alone already (gpu/dense_fp32.py)
            invariant = getattr(layer, "panels", None) is not None
            return RowwiseLinear(layer) if deterministic and not invariant else layer

        head_q4 = use_q4 and lm_head_q4 is not None and q4_shape_ok(lm_head_q4)
        split_head = fp32_split is not None and head_q4
        if split_head:
            self.lm_head = quantized(lm_head_q4, lambda: lm_head_q4.dequantize().to(
                device=device, dtype=dtype), 0, fp32_split.lm_head_rows)
        # A tied table the lm_head keeps as the file's Q8_0 codes (fp32_split): the lookup
        # dequantizes the rows it reads, so no fp32 table is resident.
        head_rows = getattr(self.lm_head, "rows", None) if split_head else None
        self.embed_codes = (head_rows[0] if config.tie_word_embeddings and head_rows
                            and len(head_rows) == 1 and isinstance(head_rows[0], Q8Rows)
                            else None)
        self._embed_table = None if self.embed_codes is not None else w("embed_tokens")
        # The token lookup; tensor parallelism swaps in its vocabulary-parallel one.
        self.embed = (partial(F.embedding, weight=self._embed_table)
                      if self._embed_table is not None
                      else partial(q8_lookup, self.embed_codes) if codes_kernel_available()
                      else self.embed_codes.lookup)
        # DP attention's MLP communication (gpu/dp_attention.py sets it): it learns each rank's
        # token count at the start of every forward.
        self.dp_attention = None
        if split_head:  # built above, before the embedding that may share its codes
            pass
        elif config.tie_word_embeddings:
            self.lm_head = make_linear(self.embed_tokens, weight_quant, both_layouts=True)
            if head_q4:
                self.lm_head = Q4Linear(lm_head_q4, min(q4_max_tokens, LM_HEAD_Q4_MAX_TOKENS),
                                        dense=self.lm_head)
        elif head_q4:
            self.lm_head = Q4Linear(lm_head_q4, q4_max_tokens)
        else:
            head = weights["lm_head"] if "lm_head" in weights else lm_head_q4.dequantize()
            self.lm_head = make_linear(head.to(device=device, dtype=dtype).contiguous(),
                                       weight_quant, both_layouts=True)
        self.lm_head = rowwise(self.lm_head)
        self.final_norm = norm("final_norm")
        self.layers = [
            DecoderLayer(input_norm=norm(f"layers.{i}.input_norm"),
                         qkv_proj=linear(f"layers.{i}.qkv_proj"),
                         o_proj=linear(f"layers.{i}.o_proj"),
                         post_attn_norm=norm(f"layers.{i}.post_attn_norm"),
                         gate_up_proj=linear(f"layers.{i}.gate_up_proj"),
                         down_proj=linear(f"layers.{i}.down_proj"),
                         qkv_bias=w(f"layers.{i}.qkv_bias") if config.qkv_bias else None,
                         qk_norm=norm(f"layers.{i}.qk_norm"),
                         attn_out_norm=norm(f"layers.{i}.attn_out_norm"),
                         mlp_out_norm=norm(f"layers.{i}.mlp_out_norm"))
            for i in range(config.num_layers)
        ]
        self.activation = GATED_ACTIVATIONS[config.mlp_activation]
        # On CUDA the residual add + norm, RoPE and SwiGLU run as one Triton kernel each
        # (gpu/fused_ops.py): a decode step's kernels are tiny, and each costs a launch.
        self.fused = fused_ops_for(device)
        # In the embedding dtype, as transformers multiplies (sqrt(640) rounds in bf16).
        self.embed_scale = (torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device=device)
                            if config.scale_embeddings else None)
        # One rope table per RoPE base; layer i rotates with ropes[rope_of_layer[i]].
        # Tables for the positions a request can reach (`max_positions`: the worker's bound,
        # its KV cache's tokens where fewer than the model's context; 96 MB for Gemma 3's two
        # bases at 32,768 positions, most never read).
        positions = min(config.max_context_len, max_positions or config.max_context_len)
        self.ropes = [RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      positions, device, dtype)]
        self.rope_of_layer = [0] * config.num_layers
        if config.local_rope_theta is not None:
            self.ropes.append(RotaryEmbedding(config.head_dim, config.local_rope_theta, None,
                                              positions, device, dtype))
            self.rope_of_layer = [int(config.layer_window(i) is not None)
                                  for i in range(config.num_layers)]

    @property
    def embed_tokens(self) -> torch.Tensor:
        """The [vocab, hidden] embedding table; where only its codes are kept (embed_codes), a
        fresh fp32 copy the caller then owns (an EAGLE-1 head's tied lm_head, a TP shard)."""
        return self._embed_table if self._embed_table is not None else \
            self.embed_codes.dequantize()

    def set_q4_max_tokens(self, max_tokens: int) -> None:
        """Change which forwards run the int4 kernel (0: none, every forward dequantizes);
        benchmarks compare both ways on one loaded model."""
        for layer in self.layers:
            for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                if isinstance(q4 := unwrap(proj), Q4Linear):
                    q4.max_tokens = max_tokens
        if isinstance(q4 := unwrap(self.lm_head), Q4Linear):
            tied = q4.dense is not None
            q4.max_tokens = min(max_tokens, LM_HEAD_Q4_MAX_TOKENS) if tied else max_tokens

    def hidden_states(self, batch: ForwardBatch, attn: AttentionBackend,
                      capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the decoder; returns final-normed hidden states and those of `capture_layers`.

        The captured states are each layer's *input* residual stream, the layout EAGLE-3 heads use.
        """
        if self.dp_attention is not None:
            self.dp_attention.begin_forward(batch.num_tokens)
        h = self.embed_input(batch.input_ids)
        rotations = self.rotations(batch.positions)
        captured: list[torch.Tensor] = []
        pending = None  # the last layer's MLP output, added to h with the next norm
        for layer_id, layer in enumerate(self.layers):
            if layer_id in capture_layers:
                if pending is not None:
                    h.add_(pending)
                    pending = None
                captured.append(h)
                h = h.clone()  # the residual adds below are in place
            h, pending = self.layer_forward(layer, h, pending,
                                            rotations[self.rope_of_layer[layer_id]],
                                            partial(attn.forward, layer_id=layer_id, batch=batch))
        return self.final_hidden(h, pending), captured

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings, scaled where the model scales them (Gemma)."""
        h = self.embed(input_ids)
        return h if self.embed_scale is None else h * self.embed_scale

    def rotations(self, positions: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """Per RoPE table, the function that rotates a layer's q and k [tokens, heads, dim]."""
        fused = self.fused
        if fused is not None and self._fused_rope_applies():
            return [partial(fused.rope, positions=positions, cos=rope.cos,
                            signed_sin=rope.signed_sin) for rope in self.ropes]
        return [partial(apply_rope, cos=cos, signed_sin=sin)
                for cos, sin in (rope.cos_sin(positions) for rope in self.ropes)]

    def layer_forward(self, layer: DecoderLayer, h: torch.Tensor, pending: torch.Tensor | None,
                      rotate: Callable[[torch.Tensor], torch.Tensor],
                      attend: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer. `pending` (the last layer's MLP output, None for the first
        layer) is added into the residual stream h in place, with the norm; `rotate` applies
        the layer's RoPE to q and k, `attend(q, k, v)` writes the layer's KV and attends.
        Returns h and this layer's MLP output (pending for the next layer). The compiled
        decode step (gpu/compiled_decode.py) traces this once and stamps it out per layer."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        n = h.shape[0]
        qk_heads = cfg.num_heads + cfg.num_kv_heads
        x = self._add_norm(h, pending, layer.input_norm, eps)
        qkv = layer.qkv_proj(x)
        if layer.qkv_bias is not None:
            qkv.add_(layer.qkv_bias)
        # q and k are normed and rotated together: they sit side by side in the projection.
        qk = qkv[:, :qk_heads * cfg.head_dim].view(n, qk_heads, cfg.head_dim)
        if layer.qk_norm is not None:
            qk = head_rms_norm(qk, layer.qk_norm, eps)
        qk = rotate(qk)
        q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        v = qkv[:, qk_heads * cfg.head_dim:].view(n, cfg.num_kv_heads, cfg.head_dim)
        o = layer.o_proj(attend(q, k, v).reshape(n, cfg.q_size))
        if layer.attn_out_norm is not None:
            o = rms_norm(o, layer.attn_out_norm, eps)
        x = self._add_norm(h, o, layer.post_attn_norm, eps)
        gate_up = layer.gate_up_proj(x)
        fused = self.fused
        m = layer.down_proj(fused.silu_mul(gate_up) if fused is not None
                            and self.activation is swiglu else self.activation(gate_up))
        if layer.mlp_out_norm is not None:
            m = rms_norm(m, layer.mlp_out_norm, eps)
        return h, m

    def final_hidden(self, h: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
        """The residual stream after the last layer (its MLP output added), final-normed."""
        return self._add_norm(h, pending, self.final_norm, self.config.rms_norm_eps)

    def _add_norm(self, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
        """h += residual in place (none: h as it is), then h's RMSNorm."""
        if self.fused is not None and weight.dtype == h.dtype:
            return self.fused.add_rms_norm(h, residual, weight, eps)
        if residual is not None:
            h.add_(residual)
        return rms_norm(h, weight, eps)

    def _fused_rope_applies(self) -> bool:
        return self.fused.rope_applies(self.config.head_dim, self.ropes[0].cos)

    def logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        """float32 [rows, vocab], contiguous (the sampler's row-wise passes are slow on a
        transposed product). `reuse`: where the lm_head is one matrix of 8-bit codes, written
        into a buffer the model keeps, valid until the next such call: a worker's large buffers
        are mappings of their own (gpu/heap.py), and at 32 rows of Gemma 3's vocabulary the
        page faults of a fresh 33 MB a step cost a sampled step ~15%."""
        head = self._codes_head(hidden) if reuse else None
        if head is not None:
            rows = hidden.shape[0]
            if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
                self._logits_buffer = torch.empty(rows, head.out, dtype=torch.float32)  # grown
            logits = q8_matmul(hidden, head, out=self._logits_buffer[:rows])
        else:
            logits = self.lm_head(hidden).float().contiguous()
        if (cap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits

    def lm_head_tokens(self, hidden: torch.Tensor,
                       draw: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor | None:
        """logits(hidden).argmax(-1), the same tokens, where the lm_head is one matrix of
        8-bit codes on the C kernel: its product is never written (at 32 rows a 262,144-token
        vocabulary is 32 MB of logits to write and read back). None where it is not. With
        `draw` (Sampler.c_draw), the tokens the sampler would draw from the logits."""
        head = self._codes_head(hidden)
        if head is None:
            return None
        if draw is not None:
            return cpu_sampling.lm_head_draw(hidden, head, draw)
        return q8_matmul_argmax(hidden, head)

    def _codes_head(self, hidden: torch.Tensor) -> Q8Rows | None:
        """The lm_head's 8-bit codes where the C kernel takes these rows whole: one matrix of
        them, no softcap, fp32 rows (bf16 ones: logits rounded to bf16 may tie where fp32
        ones do not), at most its max_tokens."""
        head = self.lm_head
        if (self.config.final_logit_softcap is not None or not isinstance(head, CodesLinear)
                or len(head.rows) != 1 or not isinstance(head.rows[0], Q8Rows)
                or hidden.shape[0] > head.max_tokens or hidden.dtype != torch.float32):
            return None
        return head.rows[0]
