"""The 4-bit codes of a GGUF's Q4_0 / Q4_1 tensors, kept as they are in the file.

A Q4_0 or Q4_1 weight is stored in blocks of 32 consecutive inputs of one output row:

    Q4_0 (18 bytes): d (fp16), 16 bytes of nibbles     w = (q - 8) * d
    Q4_1 (20 bytes): d (fp16), m (fp16), 16 nibbles    w = q * d + m

Byte j of the nibbles holds element j in its low half and element j + 16 in its high half.
Both forms are exactly `(q - 8) * scale + zero` per block (Q4_0: zero = 0; Q4_1: zero =
m + 8 d), the layout of torch's CPU int4 matmul, so a decode step can multiply with the file's
own weights instead of a bf16 copy 3.2-3.6x its size (see gpu/q4_linear.py).

A Q8_0 tensor (34 bytes: d (fp16), 32 int8 q; w = q * d; llama.cpp's usual embedding/lm_head
type) is the exact sum of two such 4-bit weights: with q + 128 = 16 hi + lo (hi, lo in 0..15),
q d = 16 d (hi - 8) + d (lo - 8) + 8 d, i.e. hi with scale 16 d and zero 0, lo with scale d and
zero 8 d. The pair is 1.25 bytes a weight (codes, bf16 scales and zeros) against 2 for the bf16
copy, so the lm_head of a small decode forward can run on it too (gpu/q4_linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Q4_GROUP = 32  # inputs per block, both formats (and Q8_0)
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
_Q8_0_BLOCK_BYTES = 34


@dataclass
class Q4Blocks:
    """One [out, in] weight: w[o, i] = (codes[o, i] - 8) * scale[o, i // 32] + zero[o, i // 32]."""

    codes: torch.Tensor  # [out, in] uint8, 0..15
    scale: torch.Tensor  # [out, in / 32] float32
    zero: torch.Tensor  # [out, in / 32] float32

    def map_rows(self, fn) -> "Q4Blocks":
        """The same weight with `fn` (a permutation of dim 0) applied to every part."""
        return Q4Blocks(fn(self.codes), fn(self.scale), fn(self.zero))

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight (tests and checks; the runtime never materialises it from here)."""
        w = self.codes.float() - 8
        return (w.view(*self.scale.shape, Q4_GROUP) * self.scale[..., None]
                + self.zero[..., None]).view(self.codes.shape)

    @staticmethod
    def cat(parts: list["Q4Blocks"]) -> "Q4Blocks":
        """Row-wise concatenation (the fused q/k/v and gate/up projections)."""
        return Q4Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.zero for p in parts]))


def is_q4(type_name: str) -> bool:
    return type_name in _BLOCK_BYTES


def q4_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Q4Blocks:
    """Decode the raw bytes of a Q4_0/Q4_1 tensor (`tensor.data` of gguf's reader) with `rows`
    outputs of `cols` inputs."""
    size = _BLOCK_BYTES[type_name]
    if cols % Q4_GROUP or raw.size != rows * cols // Q4_GROUP * size:
        raise ValueError(f"a {type_name} tensor of {rows}x{cols} needs {rows * cols // Q4_GROUP} "
                         f"blocks of {size} bytes; got {raw.size} bytes")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // Q4_GROUP, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
        zero = m + 8 * d
    else:
        nibbles = blocks[..., 2:]
        zero = np.zeros_like(d)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return Q4Blocks(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def q8_0_as_q4_pair(raw: np.ndarray, rows: int, cols: int) -> list[Q4Blocks]:
    """The raw bytes of a Q8_0 tensor as [hi, lo]: two 4-bit weights whose sum is exactly it."""
    if cols % Q4_GROUP or raw.size != rows * cols // Q4_GROUP * _Q8_0_BLOCK_BYTES:
        raise ValueError(f"a Q8_0 tensor of {rows}x{cols} needs {rows * cols // Q4_GROUP} blocks "
                         f"of {_Q8_0_BLOCK_BYTES} bytes; got {raw.size} bytes")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // Q4_GROUP,
                                                              _Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    biased = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # 0..255
    hi = torch.from_numpy((biased >> 4).reshape(rows, cols))
    lo = torch.from_numpy((biased & 0x0F).reshape(rows, cols))
    d = torch.from_numpy(d)
    return [Q4Blocks(hi, 16 * d, torch.zeros_like(d)), Q4Blocks(lo, d.clone(), 8 * d)]
