"""The loader's own fp32 dequantize of Q4_0 / Q4_1 / Q8_0 (gpu/loader/gguf_q4.py), used for
every weight kept dense: bit-for-bit the `gguf` package's dequantize on blocks written by
gguf's own quantizer, and on the default model's real tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpu.loader.gguf_loader import open_gguf
from gpu.loader.gguf_q4 import dequantize_blocks_fp32


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_random_blocks_dequantize_bit_for_bit_as_gguf_does(type_name):
    rng = np.random.default_rng(7)
    rows, cols = 40, 160
    w = (rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 3.0, (rows, 1))).astype(np.float32)
    w[:, :32] += 0.75  # blocks away from zero: Q4_1's minimum matters
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(w, qtype)
    exact = dequantize(raw, qtype).reshape(rows, cols)
    ours = dequantize_blocks_fp32(raw, type_name, rows, cols)
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert np.array_equal(ours.numpy().view(np.uint32), exact.view(np.uint32))


def test_the_default_models_tensors_dequantize_bit_for_bit(gguf_path):
    reader = open_gguf(gguf_path)
    kinds = set()
    for tensor in reader.tensors[:40]:
        shape = tuple(reversed([int(d) for d in tensor.shape]))
        if len(shape) != 2:  # norms: F32
            continue
        ours = dequantize_blocks_fp32(tensor.data, tensor.tensor_type.name, *shape)
        if ours is None:
            assert tensor.tensor_type.name in ("F32", "F16", "BF16")
            continue
        kinds.add(tensor.tensor_type.name)
        exact = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        assert np.array_equal(ours.numpy().view(np.uint32), exact.view(np.uint32)), tensor.name
    assert kinds == {"Q4_1", "Q8_0"}


def test_other_types_are_left_to_gguf_and_a_short_tensor_is_refused():
    raw = quantize(np.ones((16, 64), np.float32), GGMLQuantizationType.Q8_0)
    assert dequantize_blocks_fp32(raw, "Q6_K", 16, 64) is None
    with pytest.raises(ValueError, match="needs 32 blocks of 34 bytes"):
        dequantize_blocks_fp32(raw[:-1], "Q8_0", 16, 64)
