"""Triton split-K decode attention ("flash decoding"): one query per request, each sequence
split into chunks attended in parallel, then merged by log-sum-exp. With a sliding window only
the last ``window`` keys are split. Interpreter and precision notes:
``gpu.attention.triton_common``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.attention.triton_common import check_inputs, online_softmax_step, use_fp32_dot

DECODE_BLOCK_N = 32  # keys per inner step of the decode kernel
DECODE_BLOCK_H = 16  # query heads per program (padded; tl.dot needs M >= 16)
DEFAULT_NUM_KV_SPLITS = 8  # sequence chunks per (request, kv head) in decode; a power of two
INTERPRETED_NUM_KV_SPLITS = 2  # the same under Triton's CPU interpreter (attention/factory.py)
NO_WINDOW = 1 << 30  # the window of full attention: longer than any sequence, fits an int32


@triton.jit
def _decode_split_len(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per chunk: whole BLOCK_N steps, so only a sequence's last step is ragged (and
    never 0, so a zero-length padding request cannot divide by zero in the reduce)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)


@triton.jit
def _decode_span(seq_len, window):
    """The first key a query at position seq_len - 1 sees, and how many it sees."""
    kv_start = tl.maximum(seq_len - window, 0)
    return kv_start, seq_len - kv_start


@triton.jit
def _decode_split_kernel(
    Q, KBuf, VBuf, ReqToToken, Slots, SeqLens, MidO, MidLse,
    sm_scale, window,
    stride_q_tok, stride_q_head,
    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head,
    stride_r2t_slot,
    stride_mo_req, stride_mo_head, stride_mo_split,
    stride_ml_req, stride_ml_head,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_BLOCKS_PER_KV: tl.constexpr,  # cdiv(GROUP, BLOCK_H)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """Program (request, head block, split): attention of up to BLOCK_H query heads sharing
    one kv head over one contiguous chunk of the sequence. Writes the chunk's normalised
    output and its log-sum-exp; the reduce kernel merges the chunks."""
    req = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    kv_head = head_block // HEAD_BLOCKS_PER_KV
    in_group = (head_block % HEAD_BLOCKS_PER_KV) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < GROUP
    heads = kv_head * GROUP + in_group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    slot = tl.load(Slots + req).to(tl.int64)
    seq_len = tl.load(SeqLens + req).to(tl.int32)
    kv_start, span = _decode_span(seq_len, window)
    per_split = _decode_split_len(span, NUM_SPLITS, BLOCK_N)
    start = kv_start + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    if end > start:
        q = tl.load(Q + req * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            # The first step of a non-empty chunk has a valid key, so m_new is finite.
            acc, m_i, l_i = online_softmax_step(
                acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                mask_n[None, :], offs_d, mask_d, sm_scale,
                stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_r2t_slot,
                FP32_DOT, False)
        out_offs = (req * stride_mo_req + heads[:, None] * stride_mo_head
                    + split * stride_mo_split + offs_d[None, :])
        tl.store(MidO + out_offs, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(MidLse + req * stride_ml_req + heads * stride_ml_head + split,
                 m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    MidO, MidLse, Out, SeqLens, window,
    stride_mo_req, stride_mo_head, stride_mo_split,
    stride_ml_req, stride_ml_head,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Program (request, query head): merge the chunks' outputs weighted by exp(lse)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(SeqLens + req).to(tl.int32)
    _, span = _decode_span(seq_len, window)
    per_split = _decode_split_len(span, NUM_SPLITS, BLOCK_N)
    num_used = tl.cdiv(span, per_split)  # non-empty chunks come first

    offs_s = tl.arange(0, NUM_SPLITS)
    mask_s = offs_s < num_used
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + req * stride_ml_req + head * stride_ml_head + offs_s, mask=mask_s,
                  other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # unused chunks weigh exp(-inf) = 0
    partial = tl.load(MidO + req * stride_mo_req + head * stride_mo_head
                      + offs_s[:, None] * stride_mo_split + offs_d[None, :],
                      mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    out = tl.sum(weight[:, None] * partial, 0) / tl.sum(weight, 0)
    tl.store(Out + req * stride_o_tok + head * stride_o_head + offs_d,
             out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     out: torch.Tensor, req_to_token: torch.Tensor, slots: torch.Tensor,
                     seq_lens: torch.Tensor, mid_out: torch.Tensor, mid_lse: torch.Tensor,
                     sm_scale: float, window: int | None = None) -> None:
    """One query per request. q, out: [bs, num_heads, head_dim]; k/v_buffer: [num_locs,
    num_kv_heads, head_dim]; slots, seq_lens: [bs] (device); mid_out: [bs, num_heads,
    num_splits, head_dim] fp32 and mid_lse: [bs, num_heads, num_splits] fp32 scratch, where
    num_splits (a power of two) sets how many chunks each sequence is split into; `window`: the
    query sees only the last `window` keys (None: all)."""
    check_inputs(q, k_buffer, v_buffer)
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    num_splits = mid_out.shape[2]
    group = num_heads // num_kv_heads
    head_blocks_per_kv = triton.cdiv(group, DECODE_BLOCK_H)
    block_d = triton.next_power_of_2(head_dim)
    window = window or NO_WINDOW
    _decode_split_kernel[(batch_size, num_kv_heads * head_blocks_per_kv, num_splits)](
        q, k_buffer, v_buffer, req_to_token, slots, seq_lens, mid_out, mid_lse,
        sm_scale, window,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_BLOCKS_PER_KV=head_blocks_per_kv, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_H=DECODE_BLOCK_H, BLOCK_N=DECODE_BLOCK_N,
        NUM_SPLITS=num_splits, FP32_DOT=use_fp32_dot(q, k_buffer),
        num_warps=4, num_stages=2,
    )
    _decode_reduce_kernel[(batch_size, num_heads)](
        mid_out, mid_lse, out, seq_lens, window,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits,
        num_warps=4, num_stages=2,
    )
