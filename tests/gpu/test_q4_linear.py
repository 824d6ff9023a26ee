"""Small forwards on a GGUF's own 4-bit codes (gpu/loader/gguf_q4.py, gpu/q4_linear.py).

The codes are checked against the gguf package's own dequantizer (bit for bit), the int4 matmul
against a float64 product of the exact weights, and the whole bf16 model on 4-bit codes against
the fp32 model (itself checked against transformers in test_model_reference.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpu.layers import DenseLinear
from gpu.llama import LlamaModel
from gpu.loader.gguf_q4 import q4_blocks, q8_0_as_q4_pair
from gpu.q4_linear import LM_HEAD_Q4_MAX_TOKENS, Q4Linear, q4_kernel_available, q4_shape_ok
from tests.gpu.teacher_forcing import TEXT, prompt_hidden, prompt_logits

pytestmark = pytest.mark.skipif(not q4_kernel_available(),
                                reason="this torch build has no CPU int4 matmul")


def quantized(type_name: str, rows: int = 48, cols: int = 96, seed: int = 0):
    """A random weight through gguf's own quantizer: (raw bytes, the exact dequantized weight)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 1.0, (rows, 1))).astype(np.float32)
    w[:, :32] += 0.5  # a block well away from zero: Q4_1's offset matters
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(rows, cols).astype(np.float32))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_codes_dequantize_exactly_as_gguf_does(type_name):
    raw, exact = quantized(type_name)
    blocks = q4_blocks(raw, type_name, *exact.shape)
    assert blocks.codes.dtype == torch.uint8 and int(blocks.codes.max()) <= 15
    assert torch.equal(blocks.dequantize(), exact)


def test_a_tensor_of_the_wrong_size_is_refused_and_odd_shapes_stay_dense():
    raw, exact = quantized("Q4_1")
    with pytest.raises(ValueError, match="needs 144 blocks of 20 bytes"):
        q4_blocks(raw[:-1], "Q4_1", *exact.shape)
    assert q4_shape_ok(q4_blocks(raw, "Q4_1", *exact.shape))
    raw40, exact40 = quantized("Q4_1", rows=40)  # the kernel packs outputs in tiles of 16
    assert not q4_shape_ok(q4_blocks(raw40, "Q4_1", *exact40.shape))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_small_forwards_use_the_codes_and_larger_ones_the_dense_weight(type_name):
    raw, exact = quantized(type_name)
    dense = DenseLinear(exact.to(torch.bfloat16))
    layer = Q4Linear(dense, q4_blocks(raw, type_name, *exact.shape), max_tokens=4)
    x = torch.randn(6, exact.shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    reference = x.double() @ exact.double().t()
    for rows in (1, 3, 4):
        y = layer(x[:rows])
        assert y.dtype == torch.bfloat16 and y.shape == (rows, exact.shape[0])
        torch.testing.assert_close(y.double(), reference[:rows], rtol=2e-2, atol=2e-2)
        # Not the dense product: the int4 kernel ran (same values, other rounding).
        assert not torch.equal(y, dense(x[:rows]))
    assert torch.equal(layer(x[:5]), dense(x[:5]))  # above max_tokens: the dense weight
    # An fp32 model (the kernel's fp32 form is a slow reference loop): always the dense weight.
    dense32 = DenseLinear(exact)
    layer32 = Q4Linear(dense32, q4_blocks(raw, type_name, *exact.shape), max_tokens=4)
    assert torch.equal(layer32(x[:1].float()), dense32(x[:1].float()))


def test_q8_0_is_exactly_the_sum_of_two_4bit_weights():
    raw, exact = quantized("Q8_0")
    hi, lo = q8_0_as_q4_pair(raw, *exact.shape)
    assert int(hi.codes.max()) <= 15 and int(lo.codes.max()) <= 15
    assert torch.equal(hi.dequantize() + lo.dequantize(), exact)
    with pytest.raises(ValueError, match="needs 144 blocks of 34 bytes"):
        q8_0_as_q4_pair(raw[:-1], *exact.shape)


def test_a_two_part_linear_adds_its_parts_in_fp32():
    raw, exact = quantized("Q8_0")
    dense = DenseLinear(exact.to(torch.bfloat16))
    layer = Q4Linear(dense, q8_0_as_q4_pair(raw, *exact.shape), max_tokens=4)
    x = torch.randn(5, exact.shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    reference = x.double() @ exact.double().t()
    y = layer(x[:4])
    assert y.dtype == torch.float32  # no second bf16 rounding of the sum
    err = (y.double() - reference[:4]).abs().mean().item()
    dense_err = (dense(x[:4]).double() - reference[:4]).abs().mean().item()
    assert err <= 1.5 * dense_err, (err, dense_err)
    worst = (y.double() - reference[:4]).abs().max().item()
    dense_worst = (dense(x[:4]).double() - reference[:4]).abs().max().item()
    assert worst <= 2 * dense_worst, (worst, dense_worst)
    assert torch.equal(layer(x), dense(x))  # above max_tokens: the dense weight


@pytest.fixture(scope="module")
def loaded_q4(gguf_path):
    from gpu.loader.load import load_model
    return load_model(gguf_path, dtype=torch.float32, progress=False, keep_q4=True)


def test_the_default_models_codes_are_its_weights(loaded_q4):
    cfg = loaded_q4.config
    names = {f"layers.{i}.{p}" for i in range(cfg.num_layers)
             for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    assert set(loaded_q4.q4) == names  # every projection of this file is Q4_1
    for name in sorted(names):
        # Same rows in the same order: q/k un-permuted for rotate-half rope, then fused.
        assert torch.equal(loaded_q4.q4[name].dequantize(), loaded_q4.weights[name]), name


def test_the_bf16_model_on_codes_tracks_the_fp32_model(loaded_q4, model_path):
    from service.tokenizer import TextTokenizer
    ids = TextTokenizer.from_model_path(model_path).encode(TEXT)[:100]
    cpu = torch.device("cpu")
    fp32 = prompt_logits(LlamaModel(loaded_q4.config, loaded_q4.weights, cpu, torch.float32), ids)
    bf16 = {k: v.to(torch.bfloat16) for k, v in loaded_q4.weights.items()}
    # Every forward on the codes (the prompt is one 100-token forward), and none.
    on_codes = LlamaModel(loaded_q4.config, bf16, cpu, torch.bfloat16, q4=loaded_q4.q4,
                          q4_max_tokens=4096)
    assert on_codes.q4_projections == 4 * loaded_q4.config.num_layers
    q4_logits = prompt_logits(on_codes, ids)
    on_codes.set_q4_max_tokens(0)
    dense_logits = prompt_logits(on_codes, ids)
    # Measured: top-1 agreement 0.98 (bf16 dense: 0.97); mean |error| 0.079 against 0.098.
    assert_tracks_fp32(q4_logits, dense_logits, fp32, min_agreement=0.93)


def assert_tracks_fp32(on_codes: torch.Tensor, dense: torch.Tensor, fp32: torch.Tensor,
                       min_agreement: float) -> None:
    """Logits on the codes: not the dense ones, top-1 as the fp32 model's at `min_agreement` of
    the positions at least, and a mean |error| at most 1.5x the dense bf16 logits'."""
    assert not torch.equal(on_codes, dense)
    err = (on_codes - fp32).abs().mean().item()
    dense_err = (dense - fp32).abs().mean().item()
    agreement = (on_codes.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert agreement >= min_agreement, f"top-1 agrees with fp32 on {agreement:.0%} of positions"
    assert err <= 1.5 * dense_err, (err, dense_err)


def test_the_default_models_lm_head_runs_on_its_q8_0_parts(loaded_q4, model_path):
    """SmolLM2's GGUF ties the lm_head to a Q8_0 embedding: two 4-bit parts, for forwards of at
    most 4 rows, with logits as close to the fp32 model's as the bf16 lm_head's."""
    from service.tokenizer import TextTokenizer
    parts = loaded_q4.lm_head_q4
    assert len(parts) == 2
    assert torch.equal(parts[0].dequantize() + parts[1].dequantize(),
                       loaded_q4.weights["embed_tokens"])
    cpu = torch.device("cpu")
    bf16 = {k: v.to(torch.bfloat16) for k, v in loaded_q4.weights.items()}
    model = LlamaModel(loaded_q4.config, bf16, cpu, torch.bfloat16, q4=loaded_q4.q4,
                       q4_max_tokens=12, lm_head_q4=parts)
    assert isinstance(model.lm_head, Q4Linear)
    assert model.lm_head.max_tokens == LM_HEAD_Q4_MAX_TOKENS
    # The final hidden states of 100 real positions, from the fp32 model.
    ids = TextTokenizer.from_model_path(model_path).encode(TEXT)[:100]
    fp32_model = LlamaModel(loaded_q4.config, loaded_q4.weights, cpu, torch.float32)
    hidden = prompt_hidden(fp32_model, ids)
    fp32 = fp32_model.logits(hidden)
    on_parts = torch.cat([model.logits(h) for h in hidden.bfloat16().split(4)])
    dense = model.lm_head.dense(hidden.bfloat16()).float()
    # Measured: top-1 agreement 0.99 (bf16 dense: 0.99); mean |error| 0.023 against 0.019.
    assert_tracks_fp32(on_parts, dense, fp32, min_agreement=0.95)
    model.set_q4_max_tokens(0)
    assert model.lm_head.max_tokens == 0


def test_fp32_models_and_a_zero_limit_keep_only_dense_weights(loaded_q4):
    cpu = torch.device("cpu")
    fp32 = LlamaModel(loaded_q4.config, loaded_q4.weights, cpu, torch.float32, q4=loaded_q4.q4,
                      q4_max_tokens=12, lm_head_q4=loaded_q4.lm_head_q4)
    assert fp32.q4_projections == 0  # the fp32 int4 kernel is a slow reference loop
    bf16 = {k: v.to(torch.bfloat16) for k, v in loaded_q4.weights.items()}
    off = LlamaModel(loaded_q4.config, bf16, cpu, torch.bfloat16, q4=loaded_q4.q4,
                     q4_max_tokens=0, lm_head_q4=loaded_q4.lm_head_q4)
    assert off.q4_projections == 0
    assert isinstance(off.layers[0].qkv_proj, DenseLinear)
    assert isinstance(off.lm_head, DenseLinear) and isinstance(fp32.lm_head, DenseLinear)


def test_a_negative_limit_is_refused_with_what_to_set(model_path):
    import msgspec

    from fmserve.engine import Engine
    with pytest.raises(msgspec.ValidationError, match=r">= 0 - at `\$.runtime.q4_max_tokens`"):
        Engine(model=str(model_path), dtype="bf16", q4_max_tokens=-3, progress=False)
