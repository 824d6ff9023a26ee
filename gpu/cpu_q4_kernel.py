"""fmserve's own CPU kernel for a decode step's few rows on 4-bit codes (gpu/csrc/q4_matmul.c).

torch's CPU int4 matmul wants bf16 input, which an AVX2-only CPU emulates, and FBGEMM's fp16
GEMM reads 2 bytes a weight. The C kernel reads the codes (0.625 bytes a weight with fp16 scales
and minimums where those are the file's own, as Q4_0's and Q4_1's are; 0.75 with fp32 ones)
and multiplies them by the input quantized to int8 per block of 32, as llama.cpp does. On a 2-core AVX2-only EPYC, SmolLM2-135M's 120 projections at one row: 6.4 ms
against 16.6 for FBGEMM fp16 and ~14 for torch's int4 kernel; its 49152x576 Q8_0 lm_head 2.4 ms.
The codes are kept interleaved 16 output rows together (Q4Rows), so that the float work of the
scales is done once per block for 16 outputs: at 32 rows that took the projections on an
AVX512-BF16 EPYC from 60 to 18.6 ms (weights in cache), at 4 rows (an EAGLE verify) from 8.5 to
3.1 ms.

The library is built at first use (gpu/c_library.py); without a C compiler `available()` is
False and the callers keep torch's kernels.
"""

from __future__ import annotations

import threading

import torch

from gpu.c_library import available, library
from gpu.codes_layout import GROUP_ROWS, Q4Rows, Q8Rows, codes_rows
from gpu.huge_pages import codes_in_huge_pages
from gpu.loader.gguf_q4 import Q4_GROUP, Int4Weight
from gpu.q4_linear import Q4Linear



def q4_matmul(x: torch.Tensor, w: Q4Rows, isa: str = "native") -> torch.Tensor:
    """x [rows, width] fp32 @ w^T -> [rows, out] fp32."""
    lib = library(isa)
    x = x.float().contiguous()
    rows, width = x.shape
    out = w.nibbles.shape[0]
    if width != 2 * w.nibbles.shape[1]:
        raise ValueError(f"input width {width} does not match the weight's "
                         f"{2 * w.nibbles.shape[1]}")
    y = torch.empty(rows, out, dtype=torch.float32)
    if lib.q4_matmul(x.data_ptr(), rows, width, w.nibbles.data_ptr(), w.scale.data_ptr(),
                     w.minimum.data_ptr(), w.fp16, out, y.data_ptr(),
                     torch.get_num_threads()) != 0:
        raise MemoryError(f"the C 4-bit kernel could not allocate for {rows} x {width}")
    return y


def q8_matmul(x: torch.Tensor, w: Q8Rows, isa: str = "native",
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, width] fp32 @ w^T -> [rows, out] fp32; written into `out` (contiguous fp32
    [rows, out]) where given and the weight has no padding rows, else a new tensor."""
    x = x.float().contiguous()
    rows, width = x.shape
    padded = w.codes.shape[0]
    if width != w.codes.shape[1]:
        raise ValueError(f"input width {width} does not match the weight's {w.codes.shape[1]}")
    if out is not None and (out.shape != (rows, w.out) or out.dtype != torch.float32
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 [{rows}, {w.out}] tensor, not "
                         f"{out.dtype} {tuple(out.shape)}")
    y = out if out is not None and padded == w.out else torch.empty(rows, padded,
                                                                    dtype=torch.float32)
    if library(isa).q8_matmul(x.data_ptr(), rows, width, w.codes.data_ptr(), w.scale.data_ptr(),
                               w.fp16, w.halves, w.narrow, padded, y.data_ptr(),
                               torch.get_num_threads()) != 0:
        raise MemoryError(f"the C 8-bit kernel could not allocate for {rows} x {width}")
    return y if padded == w.out else y[:, :w.out].contiguous()


def q8_matmul_argmax(x: torch.Tensor, w: Q8Rows, isa: str = "native") -> torch.Tensor:
    """(x [rows, width] fp32 @ w^T).argmax(-1) as int64 [rows], without the product: the same
    sums as q8_matmul, the first column of the largest (NaNs skipped), padding rows excluded."""
    x = x.float().contiguous()
    rows, width = x.shape
    if width != w.codes.shape[1]:
        raise ValueError(f"input width {width} does not match the weight's {w.codes.shape[1]}")
    tokens = torch.empty(rows, dtype=torch.int64)
    if library(isa).q8_matmul_argmax(
            x.data_ptr(), rows, width, w.codes.data_ptr(), w.scale.data_ptr(), w.fp16,
            w.halves, w.narrow, w.codes.shape[0], w.out, tokens.data_ptr(),
            torch.get_num_threads()) != 0:
        raise MemoryError(f"the C 8-bit kernel could not allocate for {rows} x {width}")
    return tokens


def q8_lookup(w: Q8Rows, ids: torch.Tensor) -> torch.Tensor:
    """Q8Rows.lookup in one C call: rows `ids` as fp32 [*ids.shape, width] (an embedding table
    kept as its codes), the same values."""
    flat = ids.reshape(-1)
    if flat.dtype != torch.int64 or not flat.is_contiguous():
        flat = flat.to(torch.int64).contiguous()
    width = w.codes.shape[1]
    out = torch.empty(*ids.shape, width)
    if library().q8_lookup(w.codes.data_ptr(), w.scale.data_ptr(), w.fp16, w.halves, width,
                            w.out, flat.data_ptr(), flat.shape[0], out.data_ptr()) != 0:
        raise IndexError(f"a token id is outside the embedding table's {w.out} rows "
                         f"(ids from {int(flat.min())} to {int(flat.max())})")
    return out


def dequantize_rows(w: "Q4Rows | Q8Rows", start: int, out: torch.Tensor) -> None:
    """Output rows [start, start + len(out)) of `w` into `out` [count, width] fp32."""
    count, width = out.shape
    lib, threads = library(), torch.get_num_threads()
    if isinstance(w, Q8Rows):
        lib.q8_dequantize(w.codes.data_ptr(), w.scale.data_ptr(), w.fp16, w.halves, width,
                          start, count, out.data_ptr(), threads)
    else:
        lib.q4_dequantize(w.nibbles.data_ptr(), w.scale.data_ptr(), w.minimum.data_ptr(), w.fp16,
                          width, start, count, out.data_ptr(), threads)


# A wide forward's weights are dequantized this many floats at a time (8 MiB): a small
# model's projections at once (SmolLM2's largest is 3072 x 576), an lm_head in pieces.
SCRATCH_FLOATS = 1 << 21
_scratch = threading.local()


def _scratch_buffer(name: str, dtype: torch.dtype) -> torch.Tensor:
    """This thread's reused scratch of SCRATCH_FLOATS elements. Made outside inference mode
    whatever the caller's: an inference tensor could not be written in place by a later call
    made outside it."""
    buf = getattr(_scratch, name, None)
    if buf is None:
        with torch.inference_mode(False):
            buf = torch.empty(SCRATCH_FLOATS, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf


def scratch_matmul(x: torch.Tensor, w: "Q4Rows | Q8Rows", bf16: bool = False) -> torch.Tensor:
    """x [rows, width] fp32 @ w^T for many rows (a prefill chunk): the codes dequantized a
    piece of outputs at a time into one reused fp32 buffer, multiplied by torch's GEMM. Near
    FBGEMM's fp16 speed from 64 rows up, with no dense copy of the weight kept. `bf16`: the
    GEMM in bf16 (weights and input rounded, output fp32 again), for a CPU with native bf16,
    where it ran 2.4-3x the fp32 GEMM on 128-512 rows (AVX512-BF16 EPYC): prefill is bound by
    the multiply there, and a bf16 model rounds the same way."""
    out, width = w.out if isinstance(w, Q8Rows) else w.nibbles.shape[0], x.shape[1]
    buf = _scratch_buffer("buf", torch.float32)
    if bf16:
        half = _scratch_buffer("half", torch.bfloat16)
        x = x.to(torch.bfloat16)
    piece = max(1, min(out, SCRATCH_FLOATS // width))
    if piece == out and not bf16:
        dequantize_rows(w, 0, buf[:out * width].view(out, width))
        return x @ buf[:out * width].view(out, width).t()
    y = torch.empty(x.shape[0], out)
    for start in range(0, out, piece):
        count = min(piece, out - start)
        wp = buf[:count * width].view(count, width)
        dequantize_rows(w, start, wp)
        if bf16:  # bf16 x bf16 has no fp32 `out=` on the CPU: the piece is copied in
            y[:, start:start + count] = x @ half[:count * width].view(count, width).copy_(wp).t()
        else:
            torch.mm(x, wp.t(), out=y[:, start:start + count])
    return y


# `q4_matmul` as an op that torch.compile traces as one opaque call (the compiled decode step,
# gpu/compiled_decode.py). Registered the low-level way: torch.library.custom_op's wrapper
# costs ~12 us a call, a quarter of a small projection's time.
_OPS = torch.library.Library("fmserve", "DEF")
_OPS.define("q4_matmul(Tensor x, Tensor nibbles, Tensor scale, Tensor minimum) -> Tensor")
_OPS.impl("q4_matmul", lambda x, nibbles, scale, minimum: q4_matmul(
    x, Q4Rows(nibbles, scale, minimum)), "CPU")


_OPS.define("q8_matmul(Tensor x, Tensor codes, Tensor scale) -> Tensor")
_OPS.impl("q8_matmul", lambda x, codes, scale: q8_matmul(x, Q8Rows(
    codes, scale, codes.shape[0], scale.shape[1] * Q4_GROUP // codes.shape[1])), "CPU")


@torch.library.register_fake("fmserve::q4_matmul")
def _(x: torch.Tensor, nibbles: torch.Tensor, scale: torch.Tensor,
      minimum: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], nibbles.shape[0], dtype=torch.float32)


@torch.library.register_fake("fmserve::q8_matmul")
def _(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32)


def _rows_matmul(x: torch.Tensor, rows: "Q4Rows | Q8Rows") -> torch.Tensor:
    if isinstance(rows, Q8Rows):
        if torch.compiler.is_compiling():
            return torch.ops.fmserve.q8_matmul(x, rows.codes, rows.scale)[:, :rows.out]
        return q8_matmul(x, rows)
    if torch.compiler.is_compiling():
        return torch.ops.fmserve.q4_matmul(x, rows.nibbles, rows.scale, rows.minimum)
    return q4_matmul(x, rows)


class CodesLinear(Q4Linear):
    """A projection of an fp32 model on its codes (gpu/cpu_kernels.py), kept only as them:
    forwards of at most `max_tokens` rows on this kernel, larger ones (prefill) on the codes
    dequantized a piece at a time into a scratch buffer (`scratch_matmul`); no dense copy of
    the weight stays resident. A Q8_0 weight (the loader's 4-bit pair) is kept as its int8
    codes, half the work and 0.75x the bytes."""

    def __init__(self, segments: Int4Weight | list[Int4Weight], max_tokens: int,
                 bf16_gemm: bool = False) -> None:
        super().__init__(segments, max_tokens, fp32_input=True)
        self.bf16_gemm = bf16_gemm  # the wide forwards' GEMM in bf16 (scratch_matmul)

    def keep_codes(self, weights: list[Int4Weight]) -> None:
        self.rows = [codes_rows(w) for w in weights]

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 [out, in] weight the kernel multiplies (a fresh copy the caller owns)."""
        return torch.cat([r.dequantize() if isinstance(r, Q8Rows) else s.fold(r.dequantize())
                          for s, r in zip(self.segments, self.rows)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        small = x.shape[0] <= self.max_tokens
        outs = []
        for s, r in zip(self.segments, self.rows):
            xs = xf if isinstance(r, Q8Rows) else s.widen(xf)
            outs.append(_rows_matmul(xs, r) if small else
                        scratch_matmul(xs.contiguous(), r, self.bf16_gemm))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y.to(x.dtype)


def codes_linear_ok(weights: Int4Weight | list[Int4Weight]) -> bool:
    """Whether the kernels take these parts: 4-bit ones of whole groups of rows, and the
    8-bit ones (a Q8_0 pair; Q6_K's digits, as int8 codes with two scales a block)."""
    parts = weights if isinstance(weights, list) else [weights]
    with codes_in_huge_pages(0):  # a trial pair's codes are not the load's: not in its buffer
        return available() and all(w.shape.width % Q4_GROUP == 0 and (
            w.shape.out_features % GROUP_ROWS == 0 or w.widening == "digits16"
            or Q8Rows.from_pair(w) is not None) for w in parts)
