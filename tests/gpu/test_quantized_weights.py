"""Weight quantization (int8, fp16) and the dense CPU layouts, against plain float references.

Kernels are checked against float64 products of the same (de)quantized weights; the quantized
model is checked against the fp32 model (itself checked against transformers in
test_model_reference.py) on a 100-token text, teacher-forced.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu.layers import DenseLinear
from gpu.llama import LlamaModel
from gpu.quantized_linear import (Fp16Linear, Int8Linear, dequantize_int8, make_linear,
                                  quantize_int8_per_channel)
from tests.gpu.teacher_forcing import TEXT, prompt_logits


def weight_with_varied_rows(out_features: int = 48, in_features: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    w *= torch.logspace(-3, 1, out_features)[:, None]  # row magnitudes over four decades
    w[5] = 0.0  # an all-zero row must survive quantization
    return w


def test_int8_round_trip_is_within_half_a_step_per_channel():
    w = weight_with_varied_rows()
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (w.shape[0],)
    assert int(q.abs().max()) <= 127
    err = (dequantize_int8(q, scale) - w).abs()
    # Round-to-nearest: at most half a quantization step, each row on its own scale.
    assert torch.all(err <= scale[:, None] * 0.5 * (1 + 1e-5))
    assert torch.all(dequantize_int8(q, scale)[5] == 0)
    nonzero = w.abs().amax(1) > 0
    # The largest entry of every row uses the full range, so no precision is wasted.
    assert torch.all(q.abs().amax(1)[nonzero] == 127)


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_int8_linear_matches_float64_product_of_dequantized_weight(rows):
    w = weight_with_varied_rows(96, 128)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    layer = Int8Linear(w)
    ref = x.double() @ dequantize_int8(layer.qweight, layer.scale).double().t()
    y = layer(x)
    assert y.dtype == x.dtype and y.shape == (rows, 96)
    # Activations and output pass through bf16 (8-bit mantissa): about 1% of the row scale.
    tol = 2e-2 * ref.abs().amax(1, keepdim=True) + 1e-6
    assert torch.all((y.double() - ref).abs() <= tol)


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_fp16_linear_matches_float64_product_of_fp16_weight(rows):
    w = weight_with_varied_rows(96, 128)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ w.half().double().t()
    y = Fp16Linear(w)(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("shape", [(96, 64), (64, 96)])  # wide (stored transposed) and narrow
@pytest.mark.parametrize("both_layouts", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 32])
def test_dense_linear_equals_f_linear_in_every_layout(shape, both_layouts, rows):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(4))
    y = DenseLinear(w, both_layouts=both_layouts)(x)
    assert y.shape == (rows, shape[0])
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_unknown_weight_quant_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="int8"):
        make_linear(torch.zeros(4, 4), "int4")


# -- the whole model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(model_path):
    from gpu.loader.load import load_model
    return load_model(model_path, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def text_ids(model_path):
    from service.tokenizer import TextTokenizer
    ids = TextTokenizer.from_model_path(model_path).encode(TEXT)
    assert len(ids) >= 100, "the test text must give at least 100 tokens"
    return ids[:100]


@pytest.fixture(scope="module")
def fp32_logits(loaded, text_ids):
    model = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32)
    return prompt_logits(model, text_ids)


@pytest.mark.parametrize("quant,min_agreement,max_abs_diff", [
    ("int8", 0.90, 5.0),   # measured: 0.96 agreement, max |diff| about 1.8
    ("fp16", 0.97, 0.25),  # measured: 1.00 agreement, max |diff| about 0.03
])
def test_quantized_model_keeps_top1_of_fp32_model(loaded, text_ids, fp32_logits, quant,
                                                  min_agreement, max_abs_diff):
    model = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32,
                       weight_quant=quant)
    logits = prompt_logits(model, text_ids)
    assert logits.shape == fp32_logits.shape
    agreement = (logits.argmax(-1) == fp32_logits.argmax(-1)).float().mean().item()
    assert agreement >= min_agreement, f"{quant}: top-1 agrees on {agreement:.0%} of positions"
    assert (logits - fp32_logits).abs().max().item() < max_abs_diff
