"""Triton causal extend (prefill) attention over req_to_token, optionally with a sliding window
or a tree mask over each request's last K keys (speculative verification), and the schedule
mapping its grid to (request, query block). Interpreter and precision notes:
``gpu.attention.triton_common``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu.attention.triton_common import check_inputs, online_softmax_step, use_fp32_dot

EXTEND_BLOCK_M = 64  # queries per extend program
EXTEND_BLOCK_N = 64  # keys per inner step of the extend kernel


@triton.jit
def _extend_kernel(
    Q, KBuf, VBuf, Out, ReqToToken, Slots, SeqLens, PrefixLens, ExtendLens, QueryStart,
    BlockReq, BlockM, TreeMask, TreeCount,
    sm_scale, batch_size, tree_k, window,
    stride_q_tok, stride_q_head,
    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head,
    stride_o_tok, stride_o_head,
    stride_r2t_slot,
    stride_tm_req, stride_tm_q, stride_tm_k, stride_tc_req,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    USE_TREE_MASK: tl.constexpr,
    SLIDING: tl.constexpr,
):
    """Program (query block, query head): BLOCK_M new tokens of one request attend to the
    request's cached prefix and, causally, to the new tokens (all read via req_to_token,
    since the new k/v were written to the pool before the launch). Query block ``b`` belongs
    to request ``BlockReq[b]`` (== batch_size for spare blocks of the grid bound).

    With ``USE_TREE_MASK`` the last ``tree_k`` keys of each request are not causal but masked
    by ``TreeMask[req, query, key - (seq_len - tree_k)]``; keys before them are visible to all
    queries (``PrefixLens`` is then unused). With ``SLIDING`` a query at position p sees keys
    p - window + 1 .. p; under a tree mask ``TreeMask`` is already windowed and a query sees
    prefix keys from ``tree_start + TreeCount[req, query] - window`` on (base.window_tree_mask)."""
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
            # key 0, so m_i is finite afterwards. With a window a row sees the prefix from
            # first_key on (every row sees its own key, so from tree_start - window + 1 on at
            # most), and may see nothing in a step.
            prefix_start = 0
            if SLIDING:
                count = tl.load(TreeCount + req * stride_tc_req + offs_m, mask=mask_m, other=1)
                first_key = tree_start + count - window
                prefix_start = tl.maximum(tree_start - window + 1, 0)
            for n0 in range(prefix_start, tree_start, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < tree_start
                visible = mask_n[None, :]
                if SLIDING:
                    visible = visible & (offs_n[None, :] >= first_key[:, None])
                acc, m_i, l_i = online_softmax_step(
                    acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                    visible, offs_d, mask_d, sm_scale,
                    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_r2t_slot,
                    FP32_DOT, SLIDING)
            # The tree's keys, masked per (query, key). With an empty prefix a row may see
            # nothing in a whole step, hence MAY_BE_EMPTY.
            tm_row = TreeMask + req * stride_tm_req + offs_m[:, None] * stride_tm_q
            for n0 in range(tree_start, seq_len, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < seq_len
                tree_bits = tl.load(tm_row + (offs_n - tree_start)[None, :] * stride_tm_k,
                                    mask=mask_m[:, None] & mask_n[None, :], other=0)
                visible = mask_n[None, :] & (tree_bits != 0)
                acc, m_i, l_i = online_softmax_step(
                    acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                    visible, offs_d, mask_d, sm_scale,
                    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_r2t_slot,
                    FP32_DOT, True)
            # A row that saw no key (only padding rows, never stored) divides 0 by 1.
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
        else:
            prefix_len = tl.load(PrefixLens + req).to(tl.int32)
            query_pos = prefix_len + offs_m
            # Keys past the block's last query are causally invisible to all of its rows, and
            # with a window so are those before its first query's window.
            kv_end = prefix_len + tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
            kv_start = 0
            if SLIDING:
                kv_start = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)
            for n0 in range(kv_start, kv_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                mask_n = offs_n < kv_end
                visible = mask_n[None, :] & (offs_n[None, :] <= query_pos[:, None])
                if SLIDING:
                    visible = visible & (offs_n[None, :] > query_pos[:, None] - window)
                # Without a window key 0 is visible to every row (padding rows included), so
                # after the first step m_i is finite and fully masked later steps contribute
                # exp(-inf) = 0. With one a row may see nothing in a step, hence MAY_BE_EMPTY.
                acc, m_i, l_i = online_softmax_step(
                    acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                    visible, offs_d, mask_d, sm_scale,
                    stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_r2t_slot,
                    FP32_DOT, SLIDING)
            if SLIDING:  # a padding row may have seen no key: 0 / 1, never stored
                l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(Out + (query_start + offs_m[:, None]) * stride_o_tok + head * stride_o_head
                 + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=mask_m[:, None] & mask_d[None, :])


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
                     tree_mask: torch.Tensor | None = None, window: int | None = None,
                     tree_count: torch.Tensor | None = None) -> None:
    """New tokens of each request (token-major, request i owns rows
    ``query_start[i] : query_start[i] + extend_lens[i]`` of q and out) attend to positions
    ``0 .. prefix_lens[i] + j`` of their request. The new tokens' k/v must already be in the
    pool. ``block_req``/``block_m`` come from :func:`extend_block_schedule`.

    With ``tree_mask`` ([bs, Q, K] bool, every extend_lens[i] == Q, needs ``seq_lens``):
    query j of request i sees keys ``0 .. seq_lens[i] - K - 1`` and key
    ``seq_lens[i] - K + k`` iff ``tree_mask[i, j, k]``; ``prefix_lens`` is not read.

    With ``window`` a query sees only the last ``window`` keys up to its own; with a tree mask
    too, ``tree_mask`` must already be windowed and ``tree_count`` [bs, Q] hold each query's
    count of visible tree keys (both from ``gpu.attention.base.window_tree_mask``)."""
    check_inputs(q, k_buffer, v_buffer)
    if window is not None and tree_mask is not None and tree_count is None:
        raise ValueError("extend_attention: a tree mask under a window needs tree_count "
                         "(gpu.attention.base.window_tree_mask)")
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
        if tree_count is None:  # unused: the prefix loop's window branch is compiled out
            tree_count = seq_lens
        tree_strides += (tree_count.stride(0),)
    else:
        # Unused pointers (the kernel's tree branch is compiled out).
        seq_lens = prefix_lens
        tree_args = (prefix_lens, 0)
        tree_count = prefix_lens
        tree_strides = (0, 0, 0, 0)
    _extend_kernel[(block_req.shape[0], num_heads)](
        q, k_buffer, v_buffer, out, req_to_token, slots, seq_lens, prefix_lens, extend_lens,
        query_start, block_req, block_m, tree_args[0], tree_count,
        sm_scale, slots.shape[0], tree_args[1], window or 0,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1),
        req_to_token.stride(0),
        *tree_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=EXTEND_BLOCK_M, BLOCK_N=EXTEND_BLOCK_N, FP32_DOT=use_fp32_dot(q, k_buffer),
        USE_TREE_MASK=use_tree, SLIDING=window is not None,
        num_warps=4, num_stages=1,
    )
