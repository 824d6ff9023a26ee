"""The form the C kernels (gpu/csrc/q4_matmul.c, q8_matmul.c) keep a GGUF's codes in: 4-bit
(Q4Rows) and 8-bit (Q8Rows) matrices with their output rows interleaved 16 together, so that
one integer multiply-add sums 16 outputs and the block scales are applied once per block for
16 outputs. Each form gives its weights back in row order (tests, the embedding lookup)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.huge_pages import in_huge_pages
from gpu.loader.gguf_q4 import Q4_GROUP, Int4Weight

# Output rows the kernel interleaves (gpu/csrc/q4_matmul.c): a weight's rows come in groups of it.
GROUP_ROWS = 16
# The largest |code| of an 8-bit weight that AVX2 sums a block of in int16 (Q8Rows.narrow).
NARROW_CODE = 16


@dataclass
class Q4Rows:
    """An [out, width] int4 matrix in the kernel's form: w = q * scale + minimum per block of
    32 inputs, the rows interleaved GROUP_ROWS together. For each group of 16 rows and block,
    8 steps of 32 bytes; step j holds inputs 4j..4j+3 of each row, 4 bytes a row, rows 0-7 in
    the low nibbles and 8-15 in the high ones. Scales and minimums are [groups, blocks, 16].
    The tensors keep the [out, ...] shapes of the plain layout (the bytes are the same count)."""

    nibbles: torch.Tensor  # [out, width / 2] uint8, interleaved as above
    scale: torch.Tensor  # [out, width / 32] fp32 or fp16, as [out / 16, width / 32, 16]
    minimum: torch.Tensor  # [out, width / 32], likewise (the scale's dtype)

    @property
    def fp16(self) -> bool:
        """Scales and minimums kept in fp16: where it holds them exactly (Q4_0 and Q4_1 store
        theirs so), which makes the codes the file's own 0.625 bytes a weight, not 0.75."""
        return self.scale.dtype == torch.float16

    @staticmethod
    def from_weight(weight: Int4Weight) -> "Q4Rows":
        b = weight.blocks
        out, width = b.codes.shape
        if out % GROUP_ROWS:
            raise ValueError(f"the 4-bit kernel takes weights of a multiple of {GROUP_ROWS} "
                             f"rows; this one has {out}")
        groups, nb = out // GROUP_ROWS, width // Q4_GROUP
        # [group, row, block, step, byte] -> [group, block, step, row, byte]
        q = b.codes.view(groups, GROUP_ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4)
        nibbles = (q[:, :, :, :8] | (q[:, :, :, 8:] << 4)).reshape(out, width // 2)
        # (q - 8) s + z = q s + (z - 8 s): in float64, so only the final rounding to fp32 errs.
        minimum = (b.zero.double() - 8 * b.scale.double()).float()
        scale = b.scale.float()
        if _exact_in_half(scale) and _exact_in_half(minimum):
            scale, minimum = scale.half(), minimum.half()
        return Q4Rows(in_huge_pages(nibbles.contiguous()), _interleave(scale),
                      _interleave(minimum))

    def codes(self) -> torch.Tensor:
        """The [out, width] codes (0..15) in row order."""
        out, half = self.nibbles.shape
        groups, nb = out // GROUP_ROWS, 2 * half // Q4_GROUP
        steps = self.nibbles.view(groups, nb, 8, 8, 4)  # [group, block, step, row % 8, byte]
        q = torch.cat([steps & 0x0F, steps >> 4], dim=3)  # rows 0-7, then 8-15
        return q.permute(0, 3, 1, 2, 4).reshape(out, 2 * half)

    def row_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and minimums [out, width / 32] in row order."""
        return _deinterleave(self.scale.float()), _deinterleave(self.minimum.float())

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out, width] matrix (tests)."""
        out = self.nibbles.shape[0]
        q = self.codes().float().view(out, -1, Q4_GROUP)
        scale, minimum = self.row_params()
        return (q * scale[..., None] + minimum[..., None]).view(out, -1)


_PAIR_ROWS = 8192


def _pair_codes(digits: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q8Rows.from_pair for rows [rows, 2, blocks, 32] of digits with their [rows, 2, blocks]
    scales and zeros: int8 codes [rows, blocks, 32] and scales [rows, blocks], or None."""
    codes = torch.zeros(digits.shape[0], digits.shape[2], Q4_GROUP, dtype=torch.int8)
    d = torch.zeros(scale.shape[0], scale.shape[2], dtype=scale.dtype)
    done = torch.zeros(d.shape, dtype=torch.bool)
    for hi, lo in ((0, 1), (1, 0)):  # Q8_0's high digit comes first, Q5_0's second
        step = scale[:, lo]
        fits = (scale[:, hi] == 16 * step) & (zero[:, hi] == 0) & ~done
        if not fits.any():
            continue
        q = digits[:, hi].short() * 16 + digits[:, lo] - 136
        low, high = q.amin(-1), q.amax(-1)
        for z in (8, -8):  # w = d (lo - 8) + z d + 16 d (hi - 8)
            ok = fits & (zero[:, lo] == z * step) & (low + z >= -128) & (high + z <= 127) & ~done
            if ok.any():
                codes = torch.where(ok[..., None], (q + z).to(torch.int8), codes)
                d = torch.where(ok, step, d)
                done |= ok
    return (codes, d) if done.all() else None


def codes_capacity(weights: list[Int4Weight]) -> int:
    """Bytes enough for the kernel's codes of these weights (`codes_in_huge_pages`): a Q4Rows
    holds two of the loader's int4 digits a byte, and a Q8Rows one int8 code per digit pair
    (Q8_0's and Q5_0's two digits side by side, Q6_K's two per weight), with up to 15 padding
    rows; each tensor is aligned to 64 bytes."""
    return sum((w.blocks.codes.shape[0] + GROUP_ROWS) * w.blocks.codes.shape[1] // 2 + 64
               for w in weights)


def _exact_in_half(values: torch.Tensor) -> bool:
    """Whether fp16 holds every one of these fp32 values exactly."""
    return torch.equal(values.half().float(), values)


def _interleave(per_row: torch.Tensor) -> torch.Tensor:
    """[out, blocks] -> the same shape holding [out / 16, blocks, 16]."""
    out, nb = per_row.shape
    return per_row.view(out // GROUP_ROWS, GROUP_ROWS, nb).transpose(1, 2).reshape(out, nb)


def _deinterleave(grouped: torch.Tensor) -> torch.Tensor:
    out, nb = grouped.shape
    return grouped.view(out // GROUP_ROWS, nb, GROUP_ROWS).transpose(1, 2).reshape(out, nb)


@dataclass
class Q8Rows:
    """An [out, width] 8-bit matrix: w = codes * scale per block of 32 inputs (Q8_0), or per
    16 with `halves` = 2 (Q6_K's codes q - 32), the rows interleaved GROUP_ROWS together as
    Q4Rows's are (for each group of 16 rows and block, 8 steps of 64 bytes; step j holds
    inputs 4j..4j+3 of each row, 4 bytes a row), zero rows padding `out` to a multiple of 16.
    The kernel's outputs past `out` are dropped."""

    codes: torch.Tensor  # [padded out, width] int8, interleaved as above
    # [padded out, width / 32 * halves] fp32 or fp16, as [groups, blocks, halves, 16]
    scale: torch.Tensor
    out: int
    halves: int = 1
    # Every code within +-NARROW_CODE (Q5_0's): AVX2 adds a block's 8 steps of int16 pairs
    # before widening them, at most 8 x 2 x 16 x 127 = 32,512 (q8_tiles_fallback.h). False is
    # always safe.
    narrow: bool = False

    @property
    def fp16(self) -> bool:
        """Scales kept in fp16, a file's own (Q8_0's and Q5_0's d): 2 bytes a block, not 4."""
        return self.scale.dtype == torch.float16

    @staticmethod
    def from_row_codes(codes: torch.Tensor, scale: torch.Tensor,
                       file_scales: bool = False) -> "Q8Rows":
        """From codes [out, width] int8 and scales [out, width / 32 * halves] in row order.
        `file_scales`: the scales are a GGUF's fp16 values, kept so where fp16 holds them."""
        out, width = codes.shape
        halves = scale.shape[1] * Q4_GROUP // width
        pad = -out % GROUP_ROWS
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, width)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        groups, nb = (out + pad) // GROUP_ROWS, width // Q4_GROUP
        # [group, row, block, step, byte] -> [group, block, step, row, byte]
        steps = codes.view(groups, GROUP_ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4)
        scale = scale.float()
        if file_scales and _exact_in_half(scale):
            scale = scale.half()
        low, high = torch.aminmax(codes)  # one pass over the codes at load
        narrow = halves == 1 and int(high) <= NARROW_CODE and int(low) >= -NARROW_CODE
        return Q8Rows(in_huge_pages(steps.reshape(out + pad, width).contiguous()),
                      _interleave(scale).contiguous(), out, halves, narrow)

    @staticmethod
    def from_pair(weight: Int4Weight) -> "Q8Rows | None":
        """A weight the loader split into two 4-bit digits side by side whose codes fit int8:
        a Q8_0 (gguf_q4.q8_0_as_q4_pair: [hi | lo], scales 16 d and d, zeros 0 and 8 d) or a
        Q5_0 (q5_as_q4_pair: [lo | hi + 8], scales d and 16 d, zeros -8 d and 0), kept as
        its int8 codes with scale d: one pass of the 8-bit kernel instead of two 4-bit ones.
        The digits' order is read block by block, so a fused projection whose rows mix the
        two (Gemma 3's q/k in Q5_0 beside its v in Q8_0) is one too. None for any other
        weight (Q5_1 and Q5_K's zeros are no multiple of d)."""
        b, n = weight.blocks, weight.in_features
        if weight.widening != "repeat" or b.codes.shape[1] != 2 * n:
            return None
        nb, out = n // Q4_GROUP, b.codes.shape[0]
        codes = torch.empty(out, n, dtype=torch.int8)
        d = torch.empty(out, nb, dtype=b.scale.dtype)
        for r in range(0, out, _PAIR_ROWS):  # int16 temporaries of a slice, not of an lm_head
            got = _pair_codes(b.codes[r:r + _PAIR_ROWS].view(-1, 2, nb, Q4_GROUP),
                              b.scale[r:r + _PAIR_ROWS].view(-1, 2, nb),
                              b.zero[r:r + _PAIR_ROWS].view(-1, 2, nb))
            if got is None:
                return None
            codes[r:r + _PAIR_ROWS], d[r:r + _PAIR_ROWS] = got[0].flatten(1), got[1]
        return Q8Rows.from_row_codes(codes, d, file_scales=True)

    @staticmethod
    def from_digits16(weight: Int4Weight) -> "Q8Rows | None":
        """A Q6_K weight (gguf_kquants.q6_k_weight: two 4-bit digits a, b per weight against
        [x16, 16 x16], scale d sc_j per 16 inputs, zero 0) as its int8 codes
        (a - 8) + 16 (b - 8) = q - 32 with those scales; None for another widening."""
        if weight.widening != "digits16":
            return None
        b = weight.blocks
        digits = b.codes.view(b.codes.shape[0], -1, 2, 16).short() - 8
        codes = (digits[:, :, 0] + 16 * digits[:, :, 1]).to(torch.int8).flatten(1)
        return Q8Rows.from_row_codes(codes, b.scale)

    @staticmethod
    def quantize(weight: torch.Tensor) -> "Q8Rows":
        """Q8_0 codes of an [out, width] float matrix (width a multiple of 32), as llama.cpp
        quantizes: per block of 32, scale = max |w| / 127 and codes = round(w / scale)."""
        out, width = weight.shape
        blocks = weight.detach().float().reshape(out, width // Q4_GROUP, Q4_GROUP)
        scale = blocks.abs().amax(-1) / 127
        codes = torch.where(scale[..., None] > 0, blocks / scale[..., None], 0).round()
        return Q8Rows.from_row_codes(codes.to(torch.int8).reshape(out, width), scale)

    def _steps(self) -> torch.Tensor:
        rows, width = self.codes.shape  # [group, block, step, row, byte]
        return self.codes.view(rows // GROUP_ROWS, width // Q4_GROUP, 8, GROUP_ROWS, 4)

    def row_codes(self) -> torch.Tensor:
        """The [out, width] codes in row order."""
        rows, width = self.codes.shape
        return self._steps().permute(0, 3, 1, 2, 4).reshape(rows, width)[:self.out]

    def row_scale(self) -> torch.Tensor:
        return _deinterleave(self.scale.float())[:self.out]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as fp32 [*ids.shape, width]: an embedding table kept as its codes."""
        group, lane = ids // GROUP_ROWS, ids % GROUP_ROWS
        q = self._steps()[group, :, :, lane].float()  # [*ids.shape, block, step, byte]
        scales = self.scale.shape[1]  # blocks x halves
        scale = self.scale.view(-1, scales, GROUP_ROWS)[group, :, lane].float()  # [*ids, scales]
        return (q.flatten(-3).unflatten(-1, (scales, -1)) * scale[..., None]).flatten(-2)

    def dequantize(self) -> torch.Tensor:
        """The fp32 [out, width] matrix (tests)."""
        out, width = self.out, self.codes.shape[1]
        return (self.row_codes().float().view(out, -1, Q4_GROUP // self.halves)
                * self.row_scale()[..., None]).view(out, width)


def codes_rows(weight: Int4Weight) -> "Q4Rows | Q8Rows":
    """The kernels' form of a weight: its int8 codes where they fit (Q8_0, Q5_0, Q6_K), else
    its 4-bit ones."""
    return Q8Rows.from_pair(weight) or Q8Rows.from_digits16(weight) or Q4Rows.from_weight(weight)
