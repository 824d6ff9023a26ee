"""The loader's own fp32 dequantize of Q4_0 / Q4_1 / Q8_0, used for every weight kept dense:
in C (gpu/loader/fp32_convert.py) and in torch where the C library is not built
(gpu/loader/gguf_q4.py). Both bit-for-bit the `gguf` package's dequantize on blocks written by
gguf's own quantizer, on blocks of every fp16 scale (subnormal ones too), and on the default
model's real tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpu.loader.gguf_loader import open_gguf
from gpu.c_library import available as c_library_available
from gpu.loader.fp32_convert import blocks_to_fp32
from gpu.loader.gguf_q4 import dequantize_blocks_fp32

WAYS = [pytest.param(dequantize_blocks_fp32, id="torch"), pytest.param(
    blocks_to_fp32, id="c", marks=pytest.mark.skipif(not c_library_available(),
                                                    reason="the C library is not built here"))]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_random_blocks_dequantize_bit_for_bit_as_gguf_does(type_name, way):
    rng = np.random.default_rng(7)
    rows, cols = 40, 160
    w = (rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 3.0, (rows, 1))).astype(np.float32)
    w[:, :32] += 0.75  # blocks away from zero: Q4_1's minimum matters
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(w, qtype)
    exact = dequantize(raw, qtype).reshape(rows, cols)
    ours = way(raw, type_name, rows, cols)
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert np.array_equal(ours.numpy().view(np.uint32), exact.view(np.uint32))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("type_name, size", [("Q4_0", 18), ("Q4_1", 20), ("Q8_0", 34)])
def test_blocks_of_any_finite_fp16_scale_dequantize_bit_for_bit(type_name, size, way):
    """Random bytes throughout: scales and minimums of every finite fp16, subnormals and
    signed zeros included (the C side converts fp16 itself), every code."""
    rng = np.random.default_rng(11)
    rows, cols = 64, 96
    raw = rng.integers(0, 256, (rows * cols // 32, size), dtype=np.uint8)
    halves = raw[:, :4].copy().view(np.uint16)  # d (and Q4_1's m): no inf or nan
    halves[(halves & 0x7C00) == 0x7C00] &= 0x83FF
    halves[:8, 0] = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0x0200]
    raw[:, :4] = halves.view(np.uint8)
    qtype = GGMLQuantizationType[type_name]
    exact = dequantize(raw, qtype).reshape(rows, cols)
    ours = way(raw, type_name, rows, cols)
    assert np.array_equal(ours.numpy().view(np.uint32), exact.view(np.uint32))


@pytest.mark.parametrize("way", WAYS)
def test_the_default_models_tensors_dequantize_bit_for_bit(gguf_path, way):
    reader = open_gguf(gguf_path)
    kinds = set()
    for tensor in reader.tensors[:40]:
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        if len(shape) != 2:  # norms: F32
            continue
        ours = way(tensor.data, tensor.tensor_type.name, *shape)
        if ours is None:
            assert tensor.tensor_type.name in ("F32", "F16", "BF16")
            continue
        kinds.add(tensor.tensor_type.name)
        exact = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        assert np.array_equal(ours.numpy().view(np.uint32), exact.view(np.uint32)), tensor.name
    assert kinds == {"Q4_1", "Q8_0"}


@pytest.mark.parametrize("way", WAYS)
def test_other_types_are_left_to_gguf_and_a_short_tensor_is_refused(way):
    raw = quantize(np.ones((16, 64), np.float32), GGMLQuantizationType.Q8_0)
    assert way(raw, "Q6_K", 16, 64) is None
    with pytest.raises(ValueError, match="needs 32 blocks of 34 bytes"):
        way(raw[:-1], "Q8_0", 16, 64)
