"""A GGUF's K-quant tensors (Q4_K, Q5_K, Q6_K) as Int4Weights, without a dense copy.

Every K-quant stores a row in super-blocks of 256 inputs (llama.cpp's ggml-quants.c; the gguf
package's `dequantize` is the reference the tests hold these to):

    Q4_K (144 bytes): d, dmin (fp16), 12 bytes of 6-bit scales sc[8] and mins m[8], 128 bytes
                      of nibbles; group j of 32: w = d sc_j q - dmin m_j, q in 0..15
    Q5_K (176 bytes): as Q4_K plus 32 bytes of fifth bits: q = lo + 16 hi in 0..31
    Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d
                      (fp16); sub-block j of 16: w = d sc_j (q - 32), q in 0..63

In torch's int4 layout (`(c - 8) * scale + zero` per group of 32, gpu/loader/gguf_q4.py):
- Q4_K is one int4 weight: c = q, scale = d sc_j, zero = 8 d sc_j - dmin m_j.
- Q5_K is two side by side (widening "repeat"): lo with Q4_K's scale and zero, and hi + 8 with
  scale 16 d sc_j and zero 0.
- Q6_K's scales change every 16 inputs, below the kernel's group of 32, and 6 bits do not fit
  in 4. Each weight is written as two balanced digits, q - 32 = (a - 8) + 16 (b - 8) with
  a = (q + 8) mod 16 and b in 6..10, and each sub-block of 16 inputs becomes one group of 32:
  [a x16 | b x16] against the input [x16, 16 x16] (widening "digits16"), scale d sc_j, zero 0.
  1 byte of codes a weight instead of 2 for bf16, and one kernel call.
All are exact in fp32; the kernel holds scales and zeros in bf16 (gpu/q4_linear.py states the
error that adds).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu.loader.gguf_q4 import Int4Weight, Q4Blocks

SUPER_BLOCK = 256
_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def is_kquant(type_name: str) -> bool:
    return type_name in _BLOCK_BYTES


def _super_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> np.ndarray:
    size = _BLOCK_BYTES[type_name]
    count = rows * cols // SUPER_BLOCK
    if cols % SUPER_BLOCK or raw.size != count * size:
        raise ValueError(f"a {type_name} tensor of {rows}x{cols} needs {count} super-blocks of "
                         f"{size} bytes; got {raw.size} bytes")
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // SUPER_BLOCK, size)


def _fp16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit scales and mins of Q4_K/Q5_K's 12 bytes [..., 12] (gguf's get_scale_min)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _low_nibbles_by_group(qs: np.ndarray) -> np.ndarray:
    """128 bytes [..., 128] -> [..., 256] codes: chunk c of 32 bytes holds group 2c in its low
    halves and group 2c + 1 in its high halves."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 256)


def _q4_k_like(blocks: np.ndarray, rows: int, cols: int):
    """Q4_K/Q5_K's shared half: per group of 32, scale d sc and min dmin m, [rows, cols / 32]."""
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sc, mins = _scales_and_mins(blocks[..., 4:16])
    scale = (d[..., None] * sc).reshape(rows, cols // 32)
    minimum = (dmin[..., None] * mins).reshape(rows, cols // 32)
    return scale, minimum


def q4_k_weight(raw: np.ndarray, rows: int, cols: int) -> Int4Weight:
    blocks = _super_blocks(raw, "Q4_K", rows, cols)
    scale, minimum = _q4_k_like(blocks, rows, cols)
    codes = _low_nibbles_by_group(blocks[..., 16:]).reshape(rows, cols)
    return Int4Weight(Q4Blocks(torch.from_numpy(codes), torch.from_numpy(scale),
                               torch.from_numpy(8 * scale - minimum)), cols)


def q5_k_weight(raw: np.ndarray, rows: int, cols: int) -> Int4Weight:
    blocks = _super_blocks(raw, "Q5_K", rows, cols)
    scale, minimum = _q4_k_like(blocks, rows, cols)
    lo = _low_nibbles_by_group(blocks[..., 48:]).reshape(rows, cols)
    fifth = blocks[..., 16:48].reshape(rows, cols // SUPER_BLOCK, 1, 32)
    hi = ((fifth >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1).reshape(rows, cols)
    scale_t = torch.from_numpy(scale)
    return Int4Weight.from_parts([
        Q4Blocks(torch.from_numpy(lo), scale_t, torch.from_numpy(8 * scale - minimum)),
        Q4Blocks(torch.from_numpy(hi + 8), 16 * scale_t, torch.zeros_like(scale_t))])


def q6_k_weight(raw: np.ndarray, rows: int, cols: int) -> Int4Weight:
    blocks = _super_blocks(raw, "Q6_K", rows, cols)
    n = blocks.shape[:2]
    ql = blocks[..., 0:128].reshape(*n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = blocks[..., 128:192].reshape(*n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        4, 1)
    q = ((ql & 0x0F).reshape(*n, 256) | ((qh & 0x03).reshape(*n, 256) << 4)).astype(np.int16)
    a = (q + 8) & 0x0F
    b = ((q - 32 - (a - 8)) >> 4) + 8  # exact: q - 32 - (a - 8) is a multiple of 16
    sixteens = rows * cols // 16
    codes = np.stack([a.reshape(sixteens, 16), b.reshape(sixteens, 16)], axis=1)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    scale = (_fp16(blocks[..., 208:210])[..., None] * sc).reshape(rows, cols // 16)
    scale_t = torch.from_numpy(scale)
    return Int4Weight(Q4Blocks(torch.from_numpy(codes.astype(np.uint8).reshape(rows, 2 * cols)),
                               scale_t, torch.zeros_like(scale_t)), cols, "digits16")


def kquant_weight(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Int4Weight:
    return {"Q4_K": q4_k_weight, "Q5_K": q5_k_weight, "Q6_K": q6_k_weight}[type_name](
        raw, rows, cols)
