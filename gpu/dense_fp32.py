"""Dense fp32 projections on the CPU in C (gpu/csrc/dense_fp32.c), where the library is built.

An engine of dtype fp32 (a safetensors model on a CPU without native bf16, or a GGUF's
weights dequantized for exactness, as the test suite runs) multiplies every projection by a
dense fp32 weight. MKL's sgemm reads W^T at memory speed for one row but multiplies a
decode's or a verify's few rows poorly; the C kernel keeps W as panels of 16 output columns
and R rows x 16-64 columns of sums in registers, reading each weight once for all the rows.
The default model's 120 projections (scripts/bench_dense_fp32.py, 2-core AVX2-only EPYC,
minimum of 5 alternated):

| rows | 1 | 2 | 4 | 8 | 16 | 64 |
|---|---|---|---|---|---|---|
| one thread: torch.mm (the layouts before), ms | 25.8 | 46.4 | 59.6 | 76.9 | 84.2 | 191.4 |
| one thread: panels, ms | 19.8 | 22.2 | 26.1 | 42.8 | 56.8 | 159.5 |
| two threads: torch.mm, ms | 26.5 | 35.4 | 51.1 | 62.0 | 71.9 | 146.3 |
| two threads: panels, ms | 11.1 | 13.8 | 14.7 | 27.7 | 40.7 | 115.3 |

A row's outputs are each one multiply-add chain over the inputs in order, so they do not
depend on the other rows of the batch. The panels are the only copy kept: the same bytes as
the W^T they replace.
"""

from __future__ import annotations

import torch

from gpu.c_library import library
from gpu.loader.fp32_convert import fp32_matrix_library

PANEL = 16  # output columns a panel holds (gpu/csrc/dense_fp32.c)


def pack_panels(weight: torch.Tensor, in_place: bool = False) -> torch.Tensor | None:
    """W [out, in] fp32 as the kernel's panels [ceil(out / 16), in, 16], the last one
    zero-padded; None where the library is not built or W is not a 2-D fp32 CPU tensor.

    `in_place`: the caller gives W up; where W owns its memory (torch's, not a file's mapping)
    and `out` is a multiple of 16, the panels take W's place, a view of its storage, and W's
    values are gone. A fresh pack's time is mostly faulting in its new pages."""
    lib = fp32_matrix_library(weight)
    if lib is None:
        return None
    out, width = weight.shape
    if in_place and _owns_its_memory(weight) and out % PANEL == 0:
        lib.fp32_pack_panels_in_place(weight.data_ptr(), out, width, torch.get_num_threads())
        return weight.view(out // PANEL, width, PANEL)
    weight = weight.contiguous()
    panels = torch.empty(-(-out // PANEL), width, PANEL, dtype=torch.float32)
    lib.fp32_pack_panels(weight.data_ptr(), out, width, panels.data_ptr(),
                         torch.get_num_threads())
    return panels


def _owns_its_memory(weight: torch.Tensor) -> bool:
    """W is the whole of a storage torch allocated (resizable: not numpy's, not a mapped
    file's, which may be read-only), so it may be overwritten."""
    storage = weight.untyped_storage()
    return (weight.is_contiguous() and weight.storage_offset() == 0 and storage.resizable()
            and storage.nbytes() == weight.numel() * weight.element_size())


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """W [out, in] back from its panels (a copy)."""
    return panels.permute(0, 2, 1).reshape(-1, panels.shape[1])[:out_features].contiguous()


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """y [rows, out] = x [rows, in] W^T, W packed by `pack_panels`."""
    if torch.compiler.is_compiling():  # one opaque op in a compiled step's graph
        return torch.ops.fmserve.dense_matmul(x, panels, out_features)
    return _matmul(x, panels, out_features)


def _matmul(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    x = x.contiguous()
    if x.dtype != torch.float32 or x.shape[1] != panels.shape[1]:
        raise ValueError(f"the dense fp32 kernel takes fp32 rows of {panels.shape[1]} inputs; "
                         f"got {x.dtype} rows of {x.shape[1]}")
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        library().fp32_panel_matmul(x.data_ptr(), x.shape[0], x.shape[1], panels.data_ptr(),
                                    out_features, y.data_ptr(), torch.get_num_threads())
    return y


# The kernel as an op torch.compile traces as one call (the compiled decode step in fp32).
_OPS = torch.library.Library("fmserve", "FRAGMENT")
_OPS.define("dense_matmul(Tensor x, Tensor panels, int out_features) -> Tensor")
_OPS.impl("dense_matmul", _matmul, "CPU")


@torch.library.register_fake("fmserve::dense_matmul")
def _(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)
