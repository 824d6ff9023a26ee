"""Slicing an int4 weight (gpu/loader/gguf_q4.py's `Int4Weight`) for tensor parallelism
without dequantizing it: the file's codes, scales and zeros are cut, never recomputed.

- by output rows (a column-parallel projection: each rank its heads, its gate/up rows): any
  rows, since every output row owns its codes and its groups' scales;
- by input columns (a row-parallel projection: o_proj over a rank's heads, down_proj over
  its intermediate slice): only at group boundaries of the widened input (32 widened
  columns; 16 inputs for Q6_K's "digits16", whose 16 inputs widen to 32). `input_columns`
  returns None where a cut would split a group; the caller then dequantizes that one
  projection (gpu/tensor_parallel.py).
"""

from __future__ import annotations

import torch

from gpu.loader.gguf_q4 import Q4_GROUP, Int4Weight, Q4Blocks


def output_rows(weight: Int4Weight, rows: torch.Tensor) -> Int4Weight:
    """The weight's output rows `rows` (int64 indices, in the order given)."""
    return weight.map_rows(lambda t: t.index_select(0, rows).contiguous())


def _widened_ranges(weight: Int4Weight, start: int, stop: int) -> list[tuple[int, int]]:
    """The widened columns that inputs [start, stop) occupy, one range per widening part."""
    shape = weight.shape
    if shape.widening == "none":
        return [(start, stop)]
    if shape.widening == "repeat":  # [x, x, ...]: the same columns in every part
        return [(p * shape.in_features + start, p * shape.in_features + stop)
                for p in range(shape.width // shape.in_features)]
    return [(2 * start, 2 * stop)]  # digits16: every 16 inputs are 32 widened columns


def input_columns(weight: Int4Weight, start: int, stop: int) -> Int4Weight | None:
    """The weight over inputs [start, stop) only (a row-parallel rank's part of the sum), or
    None when that cut does not fall on group boundaries."""
    ranges = _widened_ranges(weight, start, stop)
    if any(a % Q4_GROUP or b % Q4_GROUP for a, b in ranges):
        return None
    b = weight.blocks

    def cut(t: torch.Tensor, per: int) -> torch.Tensor:
        return torch.cat([t[:, lo // per:hi // per] for lo, hi in ranges], dim=1).contiguous()

    blocks = Q4Blocks(cut(b.codes, 1), cut(b.scale, Q4_GROUP), cut(b.zero, Q4_GROUP))
    return Int4Weight(blocks, stop - start, weight.widening)
