"""A load's fp32 conversions in C (gpu/csrc/load_ops.c), where the library is built.

An engine of dtype fp32 holds its projections dense: each GGUF tensor dequantized, then kept
as W^T where that multiplies faster (gpu/layers.py). In torch both took several passes over
the weights, ~1.7 s of the default model's 2.0 s engine build on one thread (a worker's
start, every restart, each of the test suite's fp32 engines); here each is one pass: the
dequantize 1.22 -> 0.45 s, the transposes ~0.35 -> ~0.28 s, the build 2.0 -> 1.35 s (2-core
AVX2-only EPYC). Most of what is left is faulting in 0.5 GB of fresh pages (advising them
huge was 3-8x slower: the kernel compacts memory at each fault). The dequantized values are
bit-identical to the `gguf` package's (tests/gpu/test_gguf_dequantize.py).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu.c_library import library
from gpu.loader.gguf_q4 import Q4_GROUP

# gguf_blocks_to_fp32's kinds and the block bytes the C side implies by each, by GGUF type.
_KINDS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34)}


def blocks_to_fp32(raw: np.ndarray, type_name: str, rows: int, cols: int
                   ) -> torch.Tensor | None:
    """The fp32 [rows, cols] weight of a Q4_0 / Q4_1 / Q8_0 tensor's raw bytes; None for other
    types or without the library (the caller then dequantizes in torch)."""
    lib = library()
    kind = _KINDS.get(type_name)
    if lib is None or kind is None:
        return None
    code, size = kind
    raw = np.ascontiguousarray(raw).reshape(-1)
    count = rows * cols // Q4_GROUP
    if cols % Q4_GROUP or raw.size != count * size:
        raise ValueError(f"a {type_name} tensor of {rows}x{cols} needs {count} blocks of "
                         f"{size} bytes; got {raw.size} bytes")
    out = torch.empty(rows, cols, dtype=torch.float32)
    lib.gguf_blocks_to_fp32(raw.ctypes.data, count, code, out.data_ptr(),
                            torch.get_num_threads())
    return out


def fp32_matrix_library(weight: torch.Tensor):
    """The C library where it is built and `weight` is a 2-D fp32 CPU tensor (the matrices
    its fp32 routines take), else None."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return library()


def transposed_fp32(weight: torch.Tensor) -> torch.Tensor | None:
    """weight.t().contiguous() of a 2-D fp32 CPU tensor; None where the library cannot."""
    lib = fp32_matrix_library(weight)
    if lib is None:
        return None
    weight = weight.contiguous()
    rows, cols = weight.shape
    out = torch.empty(cols, rows, dtype=torch.float32)
    lib.transpose_fp32(weight.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads())
    return out
