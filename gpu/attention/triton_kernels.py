"""Triton kernels for paged attention: split-K decode ("flash decoding") and causal extend
(optionally with a tree mask over each request's last K keys, for speculative verification).

Both kernels read K/V through ``req_to_token[slot, pos]`` (the KV-pool location of token
``pos`` of the request in ``slot``), so pages may be scattered anywhere in the pool and the
page size never enters the kernels. Everything a launch needs is on the device or bounded by
tensor shapes: no host copy of sequence lengths, so the backend can declare
``needs_cpu_seq_lens = False``.

Running on the CPU: Triton has no CPU backend, but its interpreter executes the same kernels
on CPU tensors (slowly, with numpy). ``triton.jit`` picks the interpreter when
``TRITON_INTERPRET=1`` is in the environment *at the moment this module is imported* (the
decorator reads it). So set it before the first ``import gpu.attention.triton_kernels``::

    TRITON_INTERPRET=1 python -c "import gpu.attention.triton_kernels"

Importing ``triton`` or ``torch`` earlier is harmless; importing this module earlier is not
(reload it after setting the variable, see ``KERNELS_INTERPRETED``).

Precision: softmax statistics and accumulators are fp32. Dot products run in the inputs' own
16-bit type (fp32 accumulation, exact products) when q and the pool are both bf16/fp16, and
in full fp32 (``input_precision="ieee"``, never tf32) otherwise, and always under the
interpreter, whose ``tl.dot`` gets bf16 wrong.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Whether triton.jit below built interpreted kernels (they then accept CPU tensors).
KERNELS_INTERPRETED: bool = (
    os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))

DECODE_BLOCK_N = 32  # keys per inner step of the decode kernel
DECODE_BLOCK_H = 16  # query heads per program (padded; tl.dot needs M >= 16)
DEFAULT_NUM_KV_SPLITS = 8  # sequence chunks per (request, kv head) in decode; a power of two
EXTEND_BLOCK_M = 64  # queries per extend program
EXTEND_BLOCK_N = 64  # keys per inner step of the extend kernel


@triton.jit
def _decode_split_len(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per chunk: whole BLOCK_N steps, so only a sequence's last step is ragged (and
    never 0, so a zero-length padding request cannot divide by zero in the reduce)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)


@triton.jit
def _decode_split_kernel(
    Q, KBuf, VBuf, ReqToToken, Slots, SeqLens, MidO, MidLse,
    sm_scale,
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
    per_split = _decode_split_len(seq_len, NUM_SPLITS, BLOCK_N)
    start = split * per_split
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
            loc = tl.load(ReqToToken + slot * stride_r2t_slot + offs_n, mask=mask_n,
                          other=0).to(tl.int64)
            k = tl.load(KBuf + loc[None, :] * stride_k_loc + kv_head * stride_k_head
                        + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            if FP32_DOT:
                qk = tl.dot(q, k.to(tl.float32), input_precision="ieee")
            else:
                qk = tl.dot(q, k)
            qk = tl.where(mask_n[None, :], qk * sm_scale, float("-inf"))
            # The first step of a non-empty chunk has a valid key, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VBuf + loc[:, None] * stride_v_loc + kv_head * stride_v_head
                        + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            if FP32_DOT:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out_offs = (req * stride_mo_req + heads[:, None] * stride_mo_head
                    + split * stride_mo_split + offs_d[None, :])
        tl.store(MidO + out_offs, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(MidLse + req * stride_ml_req + heads * stride_ml_head + split,
                 m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    MidO, MidLse, Out, SeqLens,
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
    per_split = _decode_split_len(seq_len, NUM_SPLITS, BLOCK_N)
    num_used = tl.cdiv(seq_len, per_split)  # non-empty chunks come first

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


@triton.jit
def _extend_step(acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                 visible, offs_d, mask_d, sm_scale,
                 stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_r2t_slot,
                 FP32_DOT: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """One BLOCK_N step of online softmax: keys ``offs_n`` (valid where ``mask_n``), seen by
    each query row where ``visible`` [BLOCK_M, BLOCK_N]. With ``MAY_BE_EMPTY`` a row may have
    seen no key yet (m_i and m_new both -inf); it then stays at zero instead of going NaN."""
    loc = tl.load(ReqToToken + slot * stride_r2t_slot + offs_n, mask=mask_n,
                  other=0).to(tl.int64)
    k = tl.load(KBuf + loc[None, :] * stride_k_loc + kv_head * stride_k_head
                + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
    if FP32_DOT:
        qk = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        qk = tl.dot(q, k)
    qk = tl.where(visible, qk * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(VBuf + loc[:, None] * stride_v_loc + kv_head * stride_v_head
                + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    if FP32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q, KBuf, VBuf, Out, ReqToToken, Slots, SeqLens, PrefixLens, ExtendLens, QueryStart,
    BlockReq, BlockM, TreeMask,
    sm_scale, batch_size, tree_k,
    stride_q_tok, stride_q_head,
    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_r2t_slot,
    stride_tm_req, stride_tm_q, stride_tm_k,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    USE_TREE_MASK: tl.constexpr,
):
    """Program (query block, query head): BLOCK_M new tokens of one request attend to the
    request's cached prefix and, causally, to the new tokens (all read via req_to_token,
    since the new k/v were written to the pool before the launch). Query block ``b`` belongs
    to request ``BlockReq[b]`` (== batch_size for spare blocks of the grid bound).

    With ``USE_TREE_MASK`` the last ``tree_k`` keys of each request are not causal but masked
    by ``TreeMask[req, query, key - (seq_len - tree_k)]``; keys before them are visible to all
    queries (``PrefixLens`` is then unused)."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(BlockReq + block)
    if req < batch_size:
        m_block = tl.load(BlockM + block).to(tl.int32)
        slot = tl.load(Slots + req).to(tl.int64)
        extend_len = tl.load(ExtendLens + req).to(tl.int32)
        query_start = tl.load(QueryStart + req).to(tl.int64)
        kv_head = head // GROUP

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + (query_start + offs_m[:, None]) * stride_q_tok + head * stride_q_head
                    + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        if FP32_DOT:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if USE_TREE_MASK:
            seq_len = tl.load(SeqLens + req).to(tl.int32)
            tree_start = seq_len - tree_k
            # Shared prefix: every key visible to every row. Its first step (if any) holds
            # key 0, so m_i is finite afterwards.
            for n0 in range(0, tree_start, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < tree_start
                acc, m_i, l_i = _extend_step(
                    acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                    mask_n[None, :], offs_d, mask_d, sm_scale,
                    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_r2t_slot,
                    FP32_DOT, False)
            # The tree's keys, masked per (query, key). With an empty prefix a row may see
            # nothing in a whole step, hence MAY_BE_EMPTY.
            tm_row = TreeMask + req * stride_tm_req + offs_m[:, None] * stride_tm_q
            for n0 in range(tree_start, seq_len, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < seq_len
                tree_bits = tl.load(tm_row + (offs_n - tree_start)[None, :] * stride_tm_k,
                                    mask=mask_m[:, None] & mask_n[None, :], other=0)
                visible = mask_n[None, :] & (tree_bits != 0)
                acc, m_i, l_i = _extend_step(
                    acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                    visible, offs_d, mask_d, sm_scale,
                    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_r2t_slot,
                    FP32_DOT, True)
            # A row that saw no key (only padding rows, never stored) divides 0 by 1.
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        else:
            prefix_len = tl.load(PrefixLens + req).to(tl.int32)
            query_pos = prefix_len + offs_m
            # Keys past the block's last query are causally invisible to all of its rows.
            kv_end = prefix_len + tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
            for n0 in range(0, kv_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < kv_end
                visible = mask_n[None, :] & (offs_n[None, :] <= query_pos[:, None])
                # Key 0 is visible to every row (padding rows included), so after the first
                # step m_i is finite and fully masked later steps contribute exp(-inf) = 0.
                acc, m_i, l_i = _extend_step(
                    acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                    visible, offs_d, mask_d, sm_scale,
                    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_r2t_slot,
                    FP32_DOT, False)
        out = acc / l_i[:, None]
        tl.store(Out + (query_start + offs_m[:, None]) * stride_o_tok + head * stride_o_head
                 + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=mask_m[:, None] & mask_d[None, :])


def _use_fp32_dot(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    if KERNELS_INTERPRETED:
        return True  # the interpreter's tl.dot multiplies bf16 bit patterns (triton 3.9)
    low_precision = (torch.bfloat16, torch.float16)
    return not (q.dtype == k_buffer.dtype and q.dtype in low_precision)


def _check_inputs(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    if q.device.type == "cpu" and not KERNELS_INTERPRETED:
        raise RuntimeError(
            "Triton attention got CPU tensors but its kernels were built for a GPU: set "
            "TRITON_INTERPRET=1 before gpu.attention.triton_kernels is first imported (or "
            "importlib.reload it after setting the variable), or use the torch backend on CPU")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"Triton attention needs {name} contiguous in head_dim "
                             f"(got strides {tuple(t.stride())})")


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     out: torch.Tensor, req_to_token: torch.Tensor, slots: torch.Tensor,
                     seq_lens: torch.Tensor, mid_out: torch.Tensor, mid_lse: torch.Tensor,
                     sm_scale: float) -> None:
    """One query per request. q, out: [bs, num_heads, head_dim]; k/v_buffer: [num_locs,
    num_kv_heads, head_dim]; slots, seq_lens: [bs] (device); mid_out: [bs, num_heads,
    num_splits, head_dim] fp32 and mid_lse: [bs, num_heads, num_splits] fp32 scratch, where
    num_splits (a power of two) sets how many chunks each sequence is split into."""
    _check_inputs(q, k_buffer, v_buffer)
    batch_size, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    num_splits = mid_out.shape[2]
    group = num_heads // num_kv_heads
    head_blocks_per_kv = triton.cdiv(group, DECODE_BLOCK_H)
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(batch_size, num_kv_heads * head_blocks_per_kv, num_splits)](
        q, k_buffer, v_buffer, req_to_token, slots, seq_lens, mid_out, mid_lse,
        sm_scale,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_BLOCKS_PER_KV=head_blocks_per_kv, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_H=DECODE_BLOCK_H, BLOCK_N=DECODE_BLOCK_N,
        NUM_SPLITS=num_splits, FP32_DOT=_use_fp32_dot(q, k_buffer),
        num_warps=4, num_stages=2,
    )
    _decode_reduce_kernel[(batch_size, num_heads)](
        mid_out, mid_lse, out, seq_lens,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits,
        num_warps=4, num_stages=2,
    )


def extend_block_schedule(extend_lens: torch.Tensor, num_tokens: int,
                          block_m: int = EXTEND_BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Map each program of the extend grid to (request, query block within the request),
    on the device. The grid size is a host-side bound, ``sum(cdiv(len_i, block_m)) <=
    min(num_tokens, cdiv(num_tokens, block_m) + bs)``; spare programs get request ``bs``."""
    batch_size = extend_lens.shape[0]
    bound = min(num_tokens, triton.cdiv(num_tokens, block_m) + batch_size)
    blocks = (extend_lens + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    ids = torch.arange(bound, device=extend_lens.device, dtype=block_end.dtype)
    block_req = torch.searchsorted(block_end, ids, right=True)
    first_block = (block_end - blocks)[block_req.clamp(max=batch_size - 1)]
    return block_req.to(torch.int32), (ids - first_block).to(torch.int32)


def extend_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     out: torch.Tensor, req_to_token: torch.Tensor, slots: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     query_start: torch.Tensor, block_req: torch.Tensor, block_m: torch.Tensor,
                     sm_scale: float, seq_lens: torch.Tensor | None = None,
                     tree_mask: torch.Tensor | None = None) -> None:
    """New tokens of each request (token-major, request i owns rows
    ``query_start[i] : query_start[i] + extend_lens[i]`` of q and out) attend to positions
    ``0 .. prefix_lens[i] + j`` of their request. The new tokens' k/v must already be in the
    pool. ``block_req``/``block_m`` come from :func:`extend_block_schedule`.

    With ``tree_mask`` ([bs, Q, K] bool, every extend_lens[i] == Q, needs ``seq_lens``):
    query j of request i sees keys ``0 .. seq_lens[i] - K - 1`` and key
    ``seq_lens[i] - K + k`` iff ``tree_mask[i, j, k]``; ``prefix_lens`` is not read."""
    _check_inputs(q, k_buffer, v_buffer)
    _, num_heads, head_dim = q.shape
    group = num_heads // k_buffer.shape[1]
    use_tree = tree_mask is not None
    if use_tree:
        if seq_lens is None:
            raise ValueError("extend_attention with a tree_mask needs seq_lens")
        if tree_mask.dtype != torch.bool:
            tree_mask = tree_mask != 0
        tree_args = (tree_mask, tree_mask.shape[2])
        tree_strides = tree_mask.stride()
    else:
        # Unused pointers (the kernel's tree branch is compiled out).
        seq_lens = prefix_lens
        tree_args = (prefix_lens, 0)
        tree_strides = (0, 0, 0)
    _extend_kernel[(block_req.shape[0], num_heads)](
        q, k_buffer, v_buffer, out, req_to_token, slots, seq_lens, prefix_lens, extend_lens,
        query_start, block_req, block_m, tree_args[0],
        sm_scale, slots.shape[0], tree_args[1],
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1),
        req_to_token.stride(0),
        *tree_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=EXTEND_BLOCK_M, BLOCK_N=EXTEND_BLOCK_N, FP32_DOT=_use_fp32_dot(q, k_buffer),
        USE_TREE_MASK=use_tree,
        num_warps=4, num_stages=1,
    )
