"""What the Triton paged-attention kernels (``triton_decode``, ``triton_extend``) share.

Both kernels read K/V through ``req_to_token[slot, pos]`` (the KV-pool location of token
``pos`` of the request in ``slot``), so pages may be scattered anywhere in the pool and the
page size never enters the kernels. Everything a launch needs is on the device or bounded by
tensor shapes: no host copy of sequence lengths, so the backend can declare
``needs_cpu_seq_lens = False``.

Running on the CPU: Triton has no CPU backend, but its interpreter executes the same kernels
on CPU tensors (slowly, with numpy). ``triton.jit`` picks the interpreter when
``TRITON_INTERPRET=1`` is in the environment *at the moment a kernel module is imported* (the
decorator reads it). So set it before the first ``import gpu.attention.triton_decode`` (or
``triton_extend``)::

    TRITON_INTERPRET=1 python -c "import gpu.attention.triton_decode"

Importing ``triton`` or ``torch`` earlier is harmless; importing the kernel modules earlier is
not (reload this module, then them, after setting the variable; see ``KERNELS_INTERPRETED``).

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

# Whether triton.jit built the kernel modules' kernels interpreted (they then accept CPU
# tensors): the kernel modules import this one first, so both read the same environment.
KERNELS_INTERPRETED: bool = (
    os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))


def use_fp32_dot(q: torch.Tensor, k_buffer: torch.Tensor) -> bool:
    if KERNELS_INTERPRETED:
        return True  # the interpreter's tl.dot multiplies bf16 bit patterns (triton 3.9)
    low_precision = (torch.bfloat16, torch.float16)
    return not (q.dtype == k_buffer.dtype and q.dtype in low_precision)


def check_inputs(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    if q.device.type == "cpu" and not KERNELS_INTERPRETED:
        raise RuntimeError(
            "Triton attention got CPU tensors but its kernels were built for a GPU: set "
            "TRITON_INTERPRET=1 before gpu.attention.triton_decode and triton_extend are "
            "first imported (or importlib.reload triton_common, then them, after setting the "
            "variable), or use the torch backend on CPU")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"Triton attention needs {name} contiguous in head_dim "
                             f"(got strides {tuple(t.stride())})")


@triton.jit
def online_softmax_step(acc, m_i, l_i, q, KBuf, VBuf, ReqToToken, slot, kv_head, offs_n, mask_n,
                        visible, offs_d, mask_d, sm_scale,
                        stride_k_loc, stride_k_head, stride_v_loc, stride_v_head,
                        stride_r2t_slot, FP32_DOT: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """One BLOCK_N step of online softmax: keys ``offs_n`` (valid where ``mask_n``), seen by
    each row where ``visible`` [rows, BLOCK_N] (rows: query tokens in extend, heads in decode).
    With ``MAY_BE_EMPTY`` a row may have seen no key yet (m_i and m_new both -inf); it then
    stays at zero instead of going NaN."""
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
