"""The EAGLE-3 head's layer as one C call (gpu/csrc/head_step.c), for a drafting step's few rows.

A chain step at one stream runs the head three times; op by op in torch each forward cost
about 1 ms on a 2-core CPU, most of it the dispatch of ~40 small ops around seven 8-bit
projections, and the draft backend's metadata. Where the head's projections already run on
the C kernel's Q8_0 codes (an fp32 head on the CPU, `DraftHead.use_int8_for_small_forwards`
with fp32 codes), its layer runs in C too, over the draft pool and the same KV locations: the
embedding lookup, the first level's fc and the lm_head stay in torch. Decode batches and
causal extends (a chain's levels, the extend over the accepted path, a catch-up) of up to
`max_rows` rows; a tree level's ancestor mask and longer extends (a prompt) stay on torch.
"""

from __future__ import annotations

import ctypes

import torch

from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.codes_layout import Q8Rows
from gpu.cpu_decode_step import (NATIVE_MAX_ROWS, causal_rows, half_kv_supported,
                                  row_operands)
from gpu.cpu_q4_kernel import library
from gpu.eagle.draft_head import DraftHead
from gpu.eagle.head_linear import SmallRowsInt8Linear
from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool

_PTR, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
ROPE_TABLE_POSITIONS = 8192  # 2 MiB of cos / sin for a head of 64 dims


class _Q8Weight(ctypes.Structure):
    _fields_ = [("codes", _PTR), ("scale", _PTR), ("out", _INT), ("in_features", _INT)]


class _HeadLayer(ctypes.Structure):
    _fields_ = [("hidden", _INT), ("heads", _INT), ("kv_heads", _INT), ("head_dim", _INT),
                ("intermediate", _INT), ("kv_half", _INT), ("norm_before_residual", _INT),
                ("eps", _FLOAT), ("attn_scale", _FLOAT), ("input_norm", _PTR),
                ("hidden_norm", _PTR), ("post_norm", _PTR), ("final_norm", _PTR),
                ("qkv", _Q8Weight), ("o", _Q8Weight), ("gate_up", _Q8Weight),
                ("down", _Q8Weight), ("k_cache", _PTR), ("v_cache", _PTR)]


def _codes(linear) -> Q8Rows | None:
    return linear.q8 if isinstance(linear, SmallRowsInt8Linear) else None


def _fused(linears: list[SmallRowsInt8Linear]) -> Q8Rows:
    """One Q8Rows of several linears' stacked by output (the codes are grouped 16 output rows
    at a time, so whole groups stack as they are: why_not checks every part fills its
    groups). Each linear then reads its rows of it, so the codes are not held twice."""
    parts = [linear.q8 for linear in linears]
    fused = Q8Rows(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                   sum(p.out for p in parts))
    start = 0
    for linear, part in zip(linears, parts):
        rows = slice(start, start + part.codes.shape[0])
        linear.q8 = Q8Rows(fused.codes[rows], fused.scale[rows], part.out)
        start = rows.stop
    return fused


def why_not(head: DraftHead, draft_kv: KVPool, attn) -> str | None:
    """Why this head's layer cannot run in C (None: it can)."""
    if library() is None:
        return "the C kernel is not built"
    if not head.eagle3 or head.weight_dtype != torch.float32:
        return "it runs fp32 EAGLE-3 heads"
    if not isinstance(attn, TorchAttentionBackend) or draft_kv.dtype not in (
            torch.float32, torch.float16) or draft_kv.device.type != "cpu":
        return "it reads an fp32 or fp16 draft pool of the torch attention backend on the CPU"
    if draft_kv.dtype == torch.float16 and not half_kv_supported():
        return "this CPU has no F16C to read an fp16 draft pool"
    layer, cfg = head.midlayer, head.config
    if layer.input_layernorm is None or cfg.num_heads % cfg.num_kv_heads or cfg.head_dim % 8:
        return "its layer is not the plain EAGLE-3 one"
    for linear in (*_projections(head), head.midlayer.self_attn.o_proj,
                   head.midlayer.mlp.down_proj):
        codes = _codes(linear)
        if codes is None or codes.out % 16:
            return "its projections are not all on the C kernel's 8-bit codes"
    return None


def _projections(head: DraftHead) -> tuple:
    a, mlp = head.midlayer.self_attn, head.midlayer.mlp
    return a.q_proj, a.k_proj, a.v_proj, mlp.gate_proj, mlp.up_proj


class NativeHead:
    """`head`'s layer over batches of up to `max_rows` rows, in C, on `draft_kv`."""

    def __init__(self, head: DraftHead, draft_kv: KVPool, attn: TorchAttentionBackend,
                 max_rows: int) -> None:
        reason = why_not(head, draft_kv, attn)
        if reason is not None:
            raise ValueError(f"the C head step cannot run this head: {reason}")
        self.head, self.attn, self.lib = head, attn, library()
        self.max_rows = min(max_rows, NATIVE_MAX_ROWS)
        cfg, layer = head.config, head.midlayer
        a, mlp = layer.self_attn, layer.mlp
        # q/k/v and gate/up each one product, as the target's decode step has them.
        self._weights = {"qkv": _fused([a.q_proj, a.k_proj, a.v_proj]),
                         "gate_up": _fused([mlp.gate_proj, mlp.up_proj]),
                         "o": _codes(a.o_proj), "down": _codes(mlp.down_proj)}
        if any(v.fp16 for v in self._weights.values()):  # head_step.c reads fp32 scales
            raise ValueError("the C head step takes codes with fp32 scales (Q8Rows.quantize)")
        w = {k: _Q8Weight(v.codes.data_ptr(), v.scale.data_ptr(), v.codes.shape[0],
                          v.codes.shape[1]) for k, v in self._weights.items()}
        # The struct holds raw pointers: every tensor it names lives as long as the head.
        self._layer = _HeadLayer(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, int(draft_kv.dtype == torch.float16),
            int(layer.norm_before_residual), cfg.rms_norm_eps, attn.scale,
            layer.input_layernorm.weight.data_ptr(), layer.hidden_norm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(), head.norm.weight.data_ptr(),
            w["qkv"], w["o"], w["gate_up"], w["down"],
            draft_kv.k_buffer[0].data_ptr(), draft_kv.v_buffer[0].data_ptr())
        # cos / sin of the first positions, gathered a step (rope_tables' values: six small
        # ops a call, ~0.05 ms, where a chain step calls it three times).
        self._cos, self._sin = head.rope_tables(torch.arange(
            min(cfg.max_position_embeddings, ROPE_TABLE_POSITIONS)))
        self.runs = 0  # forwards that ran here (tests read it)

    def can_run(self, batch: ForwardBatch) -> bool:
        if batch.mode == ForwardMode.DECODE:
            return 0 < batch.batch_size <= self.max_rows and batch.max_seq_len is not None
        return (batch.mode == ForwardMode.EXTEND and batch.tree_mask is None
                and 0 < batch.num_tokens <= self.max_rows and batch.max_seq_len is not None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """As DraftHead.forward: (hidden out [n, H], its final norm [n, H])."""
        head = self.head
        rows = causal_rows(batch) if batch.mode == ForwardMode.EXTEND else batch
        emb = head.embed(batch.input_ids).float().contiguous()
        if hidden.shape[-1] != head.config.hidden_size:
            hidden = head.fc(hidden.float())  # the first level: the target's captured states
        h = hidden.float().clone(memory_format=torch.contiguous_format)  # the C step adds into h
        max_len = batch.max_seq_len  # above every position
        cos, sin = ((self._cos[batch.positions], self._sin[batch.positions])
                    if max_len <= self._cos.shape[0] else head.rope_tables(batch.positions))
        key_locs, seq_lens, out_loc = row_operands(rows, self.attn.req_to_token.req_to_token)
        normed = torch.empty_like(h)
        status = self.lib.head_step(
            ctypes.byref(self._layer), h.shape[0], _PTR(emb.data_ptr()), _PTR(h.data_ptr()),
            _PTR(cos.data_ptr()), _PTR(sin.data_ptr()), _PTR(key_locs.data_ptr()), max_len,
            _PTR(seq_lens.data_ptr()), _PTR(out_loc.data_ptr()), _PTR(normed.data_ptr()),
            torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"the C head step could not allocate its scratch for "
                              f"{h.shape[0]} rows of up to {max_len} keys")
        self.runs += 1
        return h, normed
