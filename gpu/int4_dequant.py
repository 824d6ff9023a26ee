"""Reading torch's packed CPU int4 weights back: codes for checks, bf16 W^T for large forwards.

`aten._convert_weight_to_int4pack_for_cpu` lays a [N, K] code matrix out for its own kernel, in
blocks of BLOCK_N outputs (64 with AVX-512, 32 with AVX2; measured with ATEN_CPU_CAPABILITY):
block i is K rows of BLOCK_N / 2 bytes, byte d of row k holding output i*BLOCK_N + d in its low
half and i*BLOCK_N + BLOCK_N/2 + d in its high half; a last partial block holds outputs
(n, n + 1) in a byte. That is W^T block by block, so a large forward can dequantize a chunk of
outputs straight into a bf16 [K, chunk] scratch buffer and multiply x @ W^T with the dense
kernel: no full-precision copy of the weight stays resident (gpu/q4_linear.py says when this
pays). The layout is torch's, not a documented format: `packed_block()` checks it on a probe
once and, should a build lay it out otherwise, returns None and large forwards use the int4
kernel too.
"""

from __future__ import annotations

import functools
import threading

import torch

from gpu.loader.gguf_q4 import Q4_GROUP, Int4Shape

# Outputs dequantized at a time by a large forward: about 1M weights (a 2 MB bf16 scratch).
CHUNK_WEIGHTS = 1 << 20


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(),
                                                              1)


def unpack_codes(packed: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """The [rows, cols] uint8 codes of a packed weight (the layout above)."""
    return torch.cat([c.t() for c in _code_chunks_t(packed, rows, cols, block, rows)])


def _code_chunks_t(packed: torch.Tensor, rows: int, cols: int, block: int, chunk: int):
    """W^T codes [cols, n] for consecutive chunks of outputs (`chunk` a multiple of `block`)."""
    full = rows // block * block
    for start in range(0, full, chunk):
        stop = min(start + chunk, full)
        blocks = packed[start:stop].reshape(-1, cols, block // 2)  # [blocks, K, block / 2]
        codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [blocks, K, block]
        yield codes.permute(1, 0, 2).reshape(cols, stop - start)
    if full < rows:
        pairs = packed[full:].reshape(cols, (rows - full) // 2, 1)
        yield torch.cat([pairs & 0x0F, pairs >> 4], dim=-1).reshape(cols, rows - full)


@functools.cache
def packed_block() -> int | None:
    """This torch build's BLOCK_N, checked on a probe; None if the layout is another."""
    codes = torch.randint(0, 16, (144, 64), generator=torch.Generator().manual_seed(0),
                          dtype=torch.uint8)
    packed = pack_codes(codes)
    for block in (64, 32):
        if torch.equal(unpack_codes(packed, *codes.shape, block), codes):
            return block
    return None


_scratch = threading.local()


def _buffer(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer reused by every weight's large forwards on this thread."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of the mode
            buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:numel]


def dequantized_chunks_t(weight: Int4Shape, packed: torch.Tensor,
                         scales_and_zeros: torch.Tensor, block: int):
    """(first output, bf16 W^T [in_features, n]) for consecutive chunks of outputs, each in the
    same scratch buffer: the weights the kernel multiplies by, rounded to bf16 once (scale,
    zero and widened parts combine in fp32)."""
    rows, width = weight.out_features, weight.width
    chunk = max(block, CHUNK_WEIGHTS // width // block * block)
    start = 0
    for codes_t in _code_chunks_t(packed, rows, width, block, chunk):
        n = codes_t.shape[1]
        wide = _buffer("wide", width * n, torch.float32).view(width // Q4_GROUP, Q4_GROUP, n)
        params = scales_and_zeros[:, start:start + n].float()  # [width / 32, n, 2]
        wide.copy_(codes_t.view(width // Q4_GROUP, Q4_GROUP, n))  # uint8 - 8 would wrap
        wide.sub_(8).mul_(params[:, None, :, 0]).add_(params[:, None, :, 1])
        folded = _fold_t(weight, wide.view(width, n))  # [in_features, n]
        out = _buffer("bf16", folded.numel(), torch.bfloat16).view(folded.shape)
        out.copy_(folded)
        yield start, out
        start += n


def _fold_t(weight: Int4Shape, wide_t: torch.Tensor) -> torch.Tensor:
    """Int4Shape.fold along dim 0: [width, n] -> [in_features, n]."""
    if weight.widening == "none":
        return wide_t
    if weight.widening == "repeat":
        return wide_t.view(-1, weight.in_features, wide_t.shape[1]).sum(0)
    digits = wide_t.view(-1, 2, 16, wide_t.shape[1])
    return torch.add(digits[:, 0], digits[:, 1], alpha=16).view(weight.in_features, -1)


def dequantized_matmul(x: torch.Tensor, weight: Int4Shape, packed: torch.Tensor,
                       scales_and_zeros: torch.Tensor, block: int) -> torch.Tensor:
    """x [rows, in] bf16 @ W^T, W dequantized a chunk of outputs at a time."""
    y = None
    for start, w_t in dequantized_chunks_t(weight, packed, scales_and_zeros, block):
        if start == 0 and w_t.shape[1] == weight.out_features:
            return torch.mm(x, w_t)
        if y is None:
            y = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype)
        y[:, start:start + w_t.shape[1]] = torch.mm(x, w_t)
    return y
