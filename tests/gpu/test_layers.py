"""gpu/layers.py's RMSNorms against transformers' own modules in every dtype a model runs in:
bit for bit on the CPU (the fused F.rms_norm forms must round exactly where the reference does);
on CUDA within two units in the last place, since its fused kernel sums the squares in another
order (seen on an H100: fp32 off by up to 2.1e-7 relative, fp16 now and then one rounding
step; bf16 equal)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from gpu import layers
from gpu.c_library import available as c_library_available
from gpu.layers import DenseLinear, head_rms_norm, rms_norm, transposed, transposed_in_pieces

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 576), (7, 576), (64, 640), (3, 2048)]


def assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    if DEVICE == "cpu":
        assert torch.equal(got, expected)
        return
    ulps = 2 * torch.finfo(got.dtype).eps  # relative: two steps at the value's own magnitude
    torch.testing.assert_close(got, expected, rtol=ulps, atol=ulps)


def inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    w = torch.randn(shape[-1], generator=g).to(DEVICE)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_llama_order_equals_transformers(dtype, shape):
    x, w = inputs(shape, dtype, seed=shape[0])
    ref = LlamaRMSNorm(shape[-1], eps=1e-5).to(DEVICE, dtype)
    ref.weight.data.copy_(w)
    with torch.no_grad():
        assert_matches(rms_norm(x, ref.weight.data, 1e-5), ref(x))


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_an_fp32_one_plus_w_weight_equals_gemma3(dtype, shape):
    x, w = inputs(shape, dtype, seed=10 + shape[0])
    ref = Gemma3RMSNorm(shape[-1], eps=1e-6).to(DEVICE)
    ref.weight.data.copy_(w)
    with torch.no_grad():  # the loader keeps Gemma's weight as fp32 1 + w
        assert_matches(rms_norm(x, 1.0 + ref.weight.data.float(), 1e-6), ref(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_norm_scales_each_head_by_its_own_row(dtype):
    tokens, heads, head_dim = 5, 4, 128
    x, _ = inputs((tokens, heads, head_dim), dtype, seed=3)
    weights = torch.randn(heads, head_dim, generator=torch.Generator().manual_seed(4))
    weights = weights.to(DEVICE, dtype)
    ref = LlamaRMSNorm(head_dim, eps=1e-6).to(DEVICE, dtype)
    expected = []
    with torch.no_grad():
        for h in range(heads):
            ref.weight.data.copy_(weights[h])
            expected.append(ref(x[:, h]))
        assert_matches(head_rms_norm(x, weights, 1e-6), torch.stack(expected, 1))


@pytest.mark.parametrize("shape, rows", [((130, 7), 64), ((5, 9), 64), ((192, 48), 16)])
def test_the_transpose_in_pieces_is_the_whole_transpose(shape, rows):
    weight = torch.randn(*shape)
    out = transposed_in_pieces(weight, rows)
    assert out.is_contiguous() and torch.equal(out, weight.t())


@pytest.mark.skipif(not c_library_available(), reason="the C library is not built here")
@pytest.mark.parametrize("shape", [(130, 7), (5, 9), (192, 48), (16, 16), (1, 33), (577, 1)])
def test_the_transpose_in_c_is_the_whole_transpose(shape):
    """Tiles of 16 with ragged edges both ways; a non-contiguous input is made contiguous."""
    weight = torch.randn(*shape)
    out = transposed(weight)
    assert out.is_contiguous() and torch.equal(out, weight.t())
    wide = torch.randn(shape[1], shape[0] * 2)[:, ::2]  # a strided view
    assert torch.equal(transposed(wide), wide.t())


@pytest.mark.skipif(not c_library_available(), reason="needs a C compiler for gpu/csrc")
def test_an_fp32_linear_keeps_only_the_c_kernels_panels():
    weight, x = torch.randn(200, 24), torch.randn(3, 24)
    linear = DenseLinear(weight)
    assert linear.weight is None and linear.weight_t is None
    assert linear.panels.numel() == 13 * 24 * 16  # 200 columns in 13 panels of 16
    for rows in (x[:1], x):
        assert torch.allclose(linear(rows), rows @ weight.t(), atol=1e-5)
    both = DenseLinear(weight, both_layouts=True)  # the lm_head: W kept for an EAGLE-1 head
    assert both.weight is weight and both.panels is not None


def test_without_the_library_a_wide_fp32_linear_multiplies_by_its_transposed_copy_exactly(
        monkeypatch):
    monkeypatch.setattr(layers, "pack_panels", lambda weight, in_place=False: None)
    weight, x = torch.randn(200, 24), torch.randn(3, 24)
    linear = DenseLinear(weight)
    assert linear.weight is None and torch.equal(linear.weight_t, weight.t())
    for rows in (x[:1], x):
        assert torch.allclose(linear(rows), rows @ weight.t(), atol=1e-5)
    narrow, x = DenseLinear(weight.t().contiguous()), torch.randn(4, 200)  # kept as W
    assert narrow.weight_t is None and narrow.weight is not None
    assert torch.allclose(narrow(x), x @ weight, atol=1e-4)
