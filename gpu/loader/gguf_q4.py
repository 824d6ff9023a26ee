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

Q5_0 (22 bytes: d, 4 bytes of fifth bits, 16 nibbles; w = (q - 16) d) and Q5_1 (24 bytes: d,
m, fifth bits, nibbles; w = q d + m), with q = lo + 16 hi, are a pair the same way: lo with
scale d and zero -8 d (Q5_1: 8 d + m), hi + 8 with scale 16 d and zero 0. llama.cpp writes
them where a K-quant's 256-input super-block does not divide a row (Gemma 3 270M's 640).

`Int4Weight` is the one form every kept type takes (K-quants: gpu/loader/gguf_kquants.py): an
int4 matrix in this layout over a widened input x', so that one kernel call multiplies it.
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


# How an [rows, in] input becomes the [rows, width] input of an Int4Weight's int4 matrix:
#   "none":     x' = x
#   "repeat":   x' = [x, x, ...]: the weight is the sum of parts laid side by side along the input
#   "digits16": every 16 inputs x16 become [x16, 16 * x16]: a weight w = s * (a - 8 + 16 (b - 8))
#               with two 4-bit digits a, b per weight (Q6_K; 16 * x is exact in bf16)


@dataclass(frozen=True)
class Int4Shape:
    """What a matmul needs to know of an Int4Weight besides its packed codes."""

    out_features: int
    in_features: int
    width: int  # of the int4 matrix: in_features widened
    widening: str = "none"

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        """x' [rows, width] for x [rows, in_features]."""
        if self.widening == "none":
            return x
        if self.widening == "repeat":
            return x.repeat(1, self.width // self.in_features)
        sixteens = x.reshape(x.shape[0], -1, 1, 16)
        return torch.cat([sixteens, sixteens * 16], dim=2).view(x.shape[0], -1)

    def fold(self, wide: torch.Tensor) -> torch.Tensor:
        """The [.., in_features] weight of a [.., width] one (the transpose of `widen`)."""
        if self.widening == "none":
            return wide
        if self.widening == "repeat":
            return wide.reshape(*wide.shape[:-1], -1, self.in_features).sum(-2)
        digits = wide.reshape(*wide.shape[:-1], -1, 2, 16)
        return (digits[..., 0, :] + 16 * digits[..., 1, :]).flatten(-2)


@dataclass
class Int4Weight:
    """An [out, in_features] weight as one int4 matrix `blocks` [out, width] over x' (above)."""

    blocks: Q4Blocks
    in_features: int
    widening: str = "none"

    @staticmethod
    def from_parts(parts: list[Q4Blocks]) -> "Int4Weight":
        """Parts [out, in] whose sum is the weight (a Q8_0 pair, Q5_K's two digits)."""
        if len(parts) == 1:
            return Int4Weight(parts[0], parts[0].codes.shape[1])
        side_by_side = Q4Blocks(*(torch.cat([getattr(p, f) for p in parts], dim=1)
                                  for f in ("codes", "scale", "zero")))
        return Int4Weight(side_by_side, parts[0].codes.shape[1], "repeat")

    @property
    def shape(self) -> Int4Shape:
        out, width = self.blocks.codes.shape
        return Int4Shape(out, self.in_features, width, self.widening)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight (tests, checks, and the rare projection kept dense)."""
        return self.shape.fold(self.blocks.dequantize())

    def map_rows(self, fn) -> "Int4Weight":
        return Int4Weight(self.blocks.map_rows(fn), self.in_features, self.widening)

    @staticmethod
    def cat(weights: list["Int4Weight"]) -> "Int4Weight":
        """Row-wise concatenation of weights that widen their input alike."""
        first = weights[0].shape
        if any((w.shape.widening, w.shape.width) != (first.widening, first.width) for w in weights):
            raise ValueError("only weights that widen their input alike concatenate")
        return Int4Weight(Q4Blocks.cat([w.blocks for w in weights]), first.in_features,
                          first.widening)

    def kernel_shape_ok(self) -> bool:
        """The kernel packs outputs in tiles of 16 (and inputs in groups of 32)."""
        shape = self.shape
        return shape.out_features % 16 == 0 and shape.width % Q4_GROUP == 0


def is_q4(type_name: str) -> bool:
    return type_name in _BLOCK_BYTES


def _block_array(raw: np.ndarray, type_name: str, size: int, rows: int, cols: int
                 ) -> np.ndarray:
    """The raw bytes of a tensor in blocks of 32 inputs as [rows, cols / 32, size] uint8,
    checked against its shape."""
    if cols % Q4_GROUP or raw.size != rows * cols // Q4_GROUP * size:
        raise ValueError(f"a {type_name} tensor of {rows}x{cols} needs {rows * cols // Q4_GROUP} "
                         f"blocks of {size} bytes; got {raw.size} bytes")
    return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // Q4_GROUP, size)


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte `offset` of every block, as fp32."""
    return blocks[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def q4_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Q4Blocks:
    """Decode the raw bytes of a Q4_0/Q4_1 tensor (`tensor.data` of gguf's reader) with `rows`
    outputs of `cols` inputs."""
    blocks = _block_array(raw, type_name, _BLOCK_BYTES[type_name], rows, cols)
    d = _fp16(blocks, 0)
    if type_name == "Q4_1":
        m = _fp16(blocks, 2)
        nibbles = blocks[..., 4:]
        zero = m + 8 * d
    else:
        nibbles = blocks[..., 2:]
        zero = np.zeros_like(d)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    return Q4Blocks(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero))


def q8_0_as_q4_pair(raw: np.ndarray, rows: int, cols: int) -> list[Q4Blocks]:
    """The raw bytes of a Q8_0 tensor as [hi, lo]: two 4-bit weights whose sum is exactly it."""
    blocks = _block_array(raw, "Q8_0", _Q8_0_BLOCK_BYTES, rows, cols)
    d = _fp16(blocks, 0)
    biased = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # 0..255
    hi = torch.from_numpy((biased >> 4).reshape(rows, cols))
    lo = torch.from_numpy((biased & 0x0F).reshape(rows, cols))
    d = torch.from_numpy(d)
    return [Q4Blocks(hi, 16 * d, torch.zeros_like(d)), Q4Blocks(lo, d.clone(), 8 * d)]


_Q5_BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24}


def is_q5(type_name: str) -> bool:
    return type_name in _Q5_BLOCK_BYTES


def q5_as_q4_pair(raw: np.ndarray, type_name: str, rows: int, cols: int) -> list[Q4Blocks]:
    """The raw bytes of a Q5_0/Q5_1 tensor as [lo, hi]: two 4-bit weights whose sum is exactly
    it. Byte j of the nibbles holds element j low and j + 16 high; bit i of the fifth bits
    belongs to element i (ggml's dequantize_row_q5_0)."""
    size = _Q5_BLOCK_BYTES[type_name]
    blocks = _block_array(raw, type_name, size, rows, cols)
    d = _fp16(blocks, 0)
    zero = 8 * d + _fp16(blocks, 2) if type_name == "Q5_1" else -8 * d
    fifth = blocks[..., size - 20:size - 16].copy().view(np.uint32)  # [rows, blocks, 1]
    nibbles = blocks[..., size - 16:]
    lo = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    hi = ((fifth >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8).reshape(rows, cols)
    d_t = torch.from_numpy(d)
    return [Q4Blocks(torch.from_numpy(lo), d_t, torch.from_numpy(zero)),
            Q4Blocks(torch.from_numpy(hi + 8), 16 * d_t, torch.zeros_like(d_t))]


def dequantize_blocks_fp32(raw: np.ndarray, type_name: str, rows: int, cols: int
                           ) -> torch.Tensor | None:
    """The fp32 [rows, cols] weight of a Q4_0 / Q4_1 / Q8_0 tensor, None for other types.
    Bit-for-bit the `gguf` package's dequantize (the same fp32 products and sums, d * q + m),
    in whole-tensor torch ops: ~2.5x faster than its 16-row numpy groups, which dominated
    the load (and so a worker restart) of a model kept dense."""
    size = {**_BLOCK_BYTES, "Q8_0": _Q8_0_BLOCK_BYTES}.get(type_name)
    if size is None:
        return None
    blocks = torch.from_numpy(_block_array(raw, type_name, size, rows, cols).reshape(-1, size)
                              .copy())
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if type_name == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (q * d).view(rows, cols)
    nibbles = blocks[:, size - Q4_GROUP // 2:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).float()
    if type_name == "Q4_0":
        return (d * (q - 8)).view(rows, cols)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).view(rows, cols)
