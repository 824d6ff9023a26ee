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
