"""K-quants (Q4_K, Q5_K, Q6_K) kept as int4 weights (gpu/loader/gguf_kquants.py), checked
against the gguf package's `dequantize` on real super-blocks, through our loader, and on a
whole model's greedy choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from gpu.llama import LlamaModel
from gpu.loader.gguf_kquants import kquant_weight
from gpu.loader.gguf_q4 import Int4Weight, q5_as_q4_pair, q8_0_as_q4_pair
from gpu.q4_linear import Q4Linear, q4_kernel_available
from tests.gpu.kquant_models import T, random_blocks, write_kquant_llama

pytestmark = pytest.mark.skipif(not q4_kernel_available(),
                                reason="this torch build has no CPU int4 matmul")
BF16_STEP = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding moves a value by <= 2^-8 of it


def kernel_error_bound(weights: list[Int4Weight], reference: torch.Tensor) -> torch.Tensor:
    """Per weight: what rounding scale and zero to bf16 can move (c - 8) s + z, summed over the
    widened parts (e), plus the one rounding of the result to bf16 in the scratch copy and a
    few fp32 roundings of the terms."""
    bounds = []
    for w in weights:
        b = w.blocks
        per_code = ((b.codes.float() - 8).abs().view(*b.scale.shape, 32) * b.scale.abs()[..., None]
                    + b.zero.abs()[..., None]).view(b.codes.shape)
        bounds.append(w.shape.fold(per_code))
    terms = torch.cat(bounds)
    e = BF16_STEP * terms
    return e + BF16_STEP * (reference.abs() + e) + 2.0 ** -21 * terms


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_each_kquant_is_ggufs_dequantize(kind):
    rows, cols = 80, 512  # a packed block of 64 outputs and a tail of 16
    raw = random_blocks(kind, rows, cols, np.random.default_rng(1))
    exact = torch.from_numpy(dequantize(raw, kind).reshape(rows, cols))
    weight = kquant_weight(raw, kind.name, rows, cols)
    assert int(weight.blocks.codes.max()) <= 15
    if kind == T.Q4_K:
        # The zero 8 d sc - dmin m is rounded once in fp32: within an ulp of its terms.
        b = weight.blocks
        ulp = 2.0 ** -23 * (8 * b.scale.abs() + b.zero.abs()).repeat_interleave(32, dim=1)
        assert torch.all((weight.dequantize() - exact).abs() <= ulp)
    else:
        assert torch.equal(weight.dequantize(), exact)  # bit for bit in fp32
    # What the kernel multiplies by (scale and zero in bf16), read back from its packed form.
    represented = Q4Linear(weight, max_tokens=4).dequantized_t(0).t().float()
    bound = kernel_error_bound([weight], exact)
    assert torch.all((represented - exact).abs() <= bound)
    # Largest error measured, relative to the largest weight: 4.4e-3 (Q4_K, Q5_K, Q6_K alike),
    # about twice what rounding the weights themselves to bf16 (a dense copy) gives.
    assert (represented - exact).abs().max() <= 6e-3 * exact.abs().max()
    dense_copy = (exact.bfloat16().float() - exact).abs().max()
    assert (represented - exact).abs().max() <= 3 * dense_copy
    with pytest.raises(ValueError, match="super-blocks"):
        kquant_weight(raw.reshape(-1)[:-1], kind.name, rows, cols)


@pytest.mark.parametrize("kind", [T.Q5_0, T.Q5_1])
def test_q5_0_and_q5_1_are_ggufs_dequantize(kind):
    """The 5-bit types llama.cpp's Q4_K_M uses where a row is no multiple of 256 (Gemma 3
    270M's 640 inputs): a pair of int4 weights over [x, x], bit for bit gguf's dequantize."""
    rows, cols = 80, 640
    raw = random_blocks(kind, rows, cols, np.random.default_rng(2))
    exact = torch.from_numpy(dequantize(raw, kind).reshape(rows, cols))
    weight = Int4Weight.from_parts(q5_as_q4_pair(raw, kind.name, rows, cols))
    assert weight.widening == "repeat" and int(weight.blocks.codes.max()) <= 15
    assert torch.equal(weight.dequantize(), exact)
    represented = Q4Linear(weight, max_tokens=4).dequantized_t(0).t().float()
    assert torch.all((represented - exact).abs() <= kernel_error_bound([weight], exact))
    with pytest.raises(ValueError, match="blocks of"):
        q5_as_q4_pair(raw.reshape(-1)[:-1], kind.name, rows, cols)


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    return write_kquant_llama(tmp_path_factory.mktemp("kquant") / "tiny-q4_k_m.gguf")


@pytest.fixture(scope="module")
def loaded(kquant_gguf):
    from gpu.loader.load import load_model
    return (load_model(kquant_gguf, dtype=torch.bfloat16, progress=False, keep_q4=True),
            load_model(kquant_gguf, dtype=torch.float32, progress=False))  # gguf's dequantize


def test_the_loaded_int4_weights_are_the_files(loaded):
    kept, reference = loaded
    cfg = kept.config
    assert len(kept.q4) == 4 * cfg.num_layers and not set(kept.q4) & set(kept.weights)
    qkv = kept.q4["layers.0.qkv_proj"]  # q, k as Q4_K and v as Q6_K: two row segments
    assert [w.widening for w in qkv] == ["none", "digits16"]
    assert [w.widening for w in kept.q4["layers.0.down_proj"]] == ["repeat"]  # Q5_K
    model = LlamaModel(cfg, kept.weights, torch.device("cpu"), torch.bfloat16, q4=kept.q4,
                       q4_max_tokens=4, lm_head_q4=kept.lm_head_q4)
    named = {f"layers.{i}.{p}": getattr(layer, p) for i, layer in enumerate(model.layers)
             for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    weights = dict(kept.q4, lm_head=[kept.lm_head_q4])
    for name, proj in (named | {"lm_head": model.lm_head}).items():
        assert isinstance(proj, Q4Linear), name
        represented = proj.weight.float()
        exact = reference.weights[name]
        assert torch.all((represented - exact).abs() <= kernel_error_bound(weights[name], exact)), \
            name


def test_int4_kernels_agree_with_the_dequantized_weights_on_top1(loaded):
    kept, reference = loaded
    cfg, cpu = kept.config, torch.device("cpu")
    from tests.gpu.teacher_forcing import prompt_logits
    ids = torch.randint(0, cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    on_int4 = LlamaModel(cfg, kept.weights, cpu, torch.bfloat16, q4=kept.q4, q4_max_tokens=4096,
                         lm_head_q4=kept.lm_head_q4)
    dense = LlamaModel(cfg, reference.weights, cpu, torch.bfloat16)
    fp32 = LlamaModel(cfg, reference.weights, cpu, torch.float32)
    logits = {name: prompt_logits(m, ids.tolist()).argmax(-1)
              for name, m in (("int4", on_int4), ("dense", dense), ("fp32", fp32))}
    int4_vs_dense = (logits["int4"] == logits["dense"]).float().mean().item()
    int4_vs_fp32 = (logits["int4"] == logits["fp32"]).float().mean().item()
    dense_vs_fp32 = (logits["dense"] == logits["fp32"]).float().mean().item()
    assert int4_vs_dense >= 0.98, int4_vs_dense
    assert int4_vs_fp32 >= min(0.98, dense_vs_fp32 - 0.02), (int4_vs_fp32, dense_vs_fp32)


def test_a_fused_projection_of_q5_0_and_q8_0_rows_runs_as_int8_codes():
    """Gemma 3's Q4_K_M file holds q and k in Q5_0 and, in half its layers, v in Q8_0: the
    fused q/k/v then has rows whose two 4-bit digits come in either order ([lo | hi + 8] and
    [hi | lo]). Read block by block, it is still one matrix of int8 codes, bit for bit gguf's
    dequantize of each part, and a Q5_1 part still keeps the whole fused matrix 4-bit."""
    from gpu.cpu_q4_kernel import Q8Rows
    rng = np.random.default_rng(5)
    raws = {T.Q5_0: random_blocks(T.Q5_0, 32, 128, rng), T.Q8_0: random_blocks(T.Q8_0, 16, 128, rng),
            T.Q5_1: random_blocks(T.Q5_1, 16, 128, rng)}
    exact = {k: torch.from_numpy(dequantize(raw, k).reshape(-1, 128)) for k, raw in raws.items()}
    parts = {T.Q5_0: Int4Weight.from_parts(q5_as_q4_pair(raws[T.Q5_0], "Q5_0", 32, 128)),
             T.Q8_0: Int4Weight.from_parts(q8_0_as_q4_pair(raws[T.Q8_0], 16, 128)),
             T.Q5_1: Int4Weight.from_parts(q5_as_q4_pair(raws[T.Q5_1], "Q5_1", 16, 128))}
    fused = Q8Rows.from_pair(Int4Weight.cat([parts[T.Q5_0], parts[T.Q8_0]]))
    assert fused is not None and fused.out == 48
    assert torch.equal(fused.dequantize(), torch.cat([exact[T.Q5_0], exact[T.Q8_0]]))
    assert fused.fp16  # the files' own d, 2 bytes a block
    assert Q8Rows.from_pair(Int4Weight.cat([parts[T.Q8_0], parts[T.Q5_1]])) is None


@pytest.mark.parametrize("kind", [T.Q5_0, T.Q5_1])
def test_q5_0_runs_as_int8_codes_and_q5_1_as_two_digits(kind):
    """Q5_0's codes q - 16 (-16..15) are int8 codes with Q5_0's own scale: the 8-bit kernel's
    one pass, bit for bit gguf's dequantize. Q5_1 has a minimum per block no int8 code holds:
    it stays two 4-bit digits."""
    from gpu.cpu_q4_kernel import CodesLinear, Q4Rows, Q8Rows, available
    from tests.gpu.test_cpu_q4_kernel import int8_input
    if not available():
        pytest.skip("the C kernel is not built here")
    rows, cols = 48, 640
    raw = random_blocks(kind, rows, cols, np.random.default_rng(3))
    exact = torch.from_numpy(dequantize(raw, kind).reshape(rows, cols))
    weight = Int4Weight.from_parts(q5_as_q4_pair(raw, kind.name, rows, cols))
    layer = CodesLinear(weight, 4)
    if kind == T.Q5_1:
        assert Q8Rows.from_pair(weight) is None and isinstance(layer.rows[0], Q4Rows)
        return
    codes = Q8Rows.from_pair(weight)
    assert codes is not None and isinstance(layer.rows[0], Q8Rows)
    assert codes.row_codes().min() >= -16 and codes.row_codes().max() <= 15
    assert torch.equal(codes.dequantize(), exact)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4))
    x8, d = int8_input(x)  # the kernel's sums, written out: int8 input, int8 codes, scales
    dots = torch.einsum("obj,rbj->rob", codes.row_codes().double().view(rows, -1, 32), x8.double())
    expected = (dots * codes.row_scale().double()[None] * d.double()[:, None]).sum(-1).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
