"""gpu/cpu_q4_kernel.py: fmserve's C kernel for a decode step's few rows on 4-bit codes (and
Q8_0's 8-bit ones), the form it keeps them in (checked against gguf's dequantize), CodesLinear
in the fp32 model of a CPU without native bf16, and the ops torch.compile traces."""

from __future__ import annotations

import pytest
import torch

from gpu import c_library, cpu_q4_kernel
from gpu.cpu_q4_kernel import (CodesLinear, Q4Rows, Q8Rows, codes_linear_ok, dequantize_rows,
                                q4_matmul, q8_lookup, q8_matmul, q8_matmul_argmax,
                                scratch_matmul)
from gpu.loader.gguf_q4 import Q4_GROUP, Int4Weight, Q4Blocks
from tests.gpu.test_q4_linear import int4, quantized

pytestmark = pytest.mark.skipif(not cpu_q4_kernel.available(),
                                reason="the C kernel is not built here (no C compiler, or FMSERVE_NO_C_KERNEL set)")


def random_rows(out: int, width: int, seed: int = 0) -> Q4Rows:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, width), dtype=torch.uint8, generator=gen)
    scale = torch.rand(out, width // Q4_GROUP, generator=gen) * 0.02
    zero = (torch.rand(out, width // Q4_GROUP, generator=gen) - 0.5) * 0.1
    return Q4Rows.from_weight(Int4Weight(Q4Blocks(codes, scale, zero), width))


def int8_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input as the kernels quantize it: per block of 32, scale max|x| / 127 and the values
    rounded to nearest even."""
    xb = x.view(x.shape[0], -1, Q4_GROUP)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(xb * inv[..., None]), amax / 127


def emulated(x: torch.Tensor, w: Q4Rows) -> torch.Tensor:
    """What the kernel computes, written out in torch (float64 sums): the input quantized to
    int8, integer dot products with the codes, then the scales and the minimums."""
    x8, d = int8_input(x)
    out = w.nibbles.shape[0]
    q = w.codes().double().view(out, -1, Q4_GROUP)
    scale, minimum = w.row_params()
    dots = torch.einsum("obj,rbj->rob", q, x8.double())  # [rows, out, blocks]
    scaled = dots * scale.double()[None] * d.double()[:, None]
    mins = minimum.double()[None] * (d.double() * x8.double().sum(-1))[:, None]
    return (scaled + mins).sum(-1).float()


@pytest.mark.parametrize("rows", [1, 3, 5, 13])
@pytest.mark.parametrize("out,width", [(48, 64), (576, 576), (32, 1536), (16, 96)])
def test_the_kernel_computes_what_it_says(rows, out, width):
    w = random_rows(out, width, seed=rows)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(out))
    x[0, :Q4_GROUP] = 0  # an all-zero block: scale 0, no division by it
    y = q4_matmul(x, w)
    torch.testing.assert_close(y, emulated(x, w), rtol=1e-5, atol=1e-5)
    # and close to the exact product: only the input's int8 rounding differs
    exact = x @ w.dequantize().t()
    assert ((y - exact).norm() / exact.norm()).item() < 0.01


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_kernels_form_holds_the_files_weights(type_name):
    raw, exact = quantized(type_name, rows=48, cols=96)
    weight = int4(raw, type_name, exact.shape)
    rows_form = Q4Rows.from_weight(weight)
    assert rows_form.nibbles.dtype == torch.uint8
    assert rows_form.nibbles.numel() == weight.shape.out_features * weight.shape.width // 2
    got = weight.shape.fold(rows_form.dequantize())
    # q s + (z - 8 s) in fp32 against gguf's d q + m: equal up to fp32 rounding of the sum
    torch.testing.assert_close(got, exact, rtol=0, atol=2e-6 * exact.abs().max().item())


def test_a_q8_0_weight_is_kept_as_its_int8_codes_and_multiplied_as_they_say():
    raw, exact = quantized("Q8_0", rows=48, cols=96)
    weight = int4(raw, "Q8_0", exact.shape)  # the loader's 4-bit pair
    codes = Q8Rows.from_pair(weight)
    assert codes is not None and codes.codes.dtype == torch.int8
    assert torch.equal(codes.dequantize(), exact)  # q d in fp32, as gguf computes it
    layer = CodesLinear(weight, 4)
    assert isinstance(layer.rows[0], Q8Rows) and torch.equal(layer.weight, exact)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5))
    x8, d = int8_input(x)
    dots = torch.einsum("obj,rbj->rob", codes.row_codes().double().view(48, -1, Q4_GROUP),
                        x8.double())
    expected = (dots * codes.row_scale().double()[None] * d.double()[:, None]).sum(-1).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x), q8_matmul(x, codes))
    with pytest.raises(ValueError, match="input width 32 does not match the weight's 96"):
        q8_matmul(torch.randn(1, 32), codes)


def test_quantizing_to_q8_0_agrees_with_gguf_and_rounds_each_weight_to_its_block():
    """Q8Rows.quantize (a draft head's fp32 weights for the 8-bit kernel): a weight gguf has
    quantized to Q8_0 comes back as gguf's own codes and scales, and any weight is within half
    a step of its block's scale."""
    raw, exact = quantized("Q8_0", rows=48, cols=96)
    again = Q8Rows.quantize(exact)
    assert again.codes.dtype == torch.int8 and torch.equal(again.dequantize(), exact)
    assert torch.equal(again.row_codes(), Q8Rows.from_pair(int4(raw, "Q8_0", exact.shape)).row_codes())
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(2)) * 3
    w[0, :32] = 0  # an all-zero block: scale 0, codes 0, no division by zero
    q = Q8Rows.quantize(w)
    step = q.row_scale().repeat_interleave(Q4_GROUP, dim=1)
    assert (q.dequantize() - w).abs().le(step / 2 + 1e-6).all()
    assert q.row_codes().abs().max().item() == 127 and not q.row_codes()[0, :32].any()


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_the_8_bit_kernel_gives_each_row_alone_what_it_gives_it_in_a_batch(isa):
    """Rows go through the kernel in tiles (the codes made unsigned once per step for all of
    them), in each build (AVX-512 VNNI, AVX2, plain C): a row's result must not depend on the
    rows beside it, and must still be the written-out sum, -128 codes included (a file may
    hold them; the VNNI build's offset of 128 takes them to 0). 40 rows: the kernel runs 48,
    its last 8 zero padding."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    raw, exact = quantized("Q8_0", rows=40, cols=128)
    codes = Q8Rows.from_pair(int4(raw, "Q8_0", exact.shape))
    assert codes.codes.shape == (48, 128) and codes.out == 40
    assert torch.equal(codes.dequantize(), exact)
    codes.codes[:16, :64] = -128  # the first group's first two blocks
    x = torch.randn(11, 128, generator=torch.Generator().manual_seed(8))  # VNNI tiles 8, 3
    batch = q8_matmul(x, codes, isa)
    assert batch.shape == (11, 40)
    for i in range(11):
        assert torch.equal(q8_matmul(x[i:i + 1], codes, isa)[0], batch[i]), i
    x8, d = int8_input(x)
    dots = torch.einsum("obj,rbj->rob", codes.row_codes().double().view(40, -1, Q4_GROUP),
                        x8.double())
    expected = (dots * codes.row_scale().double()[None] * d.double()[:, None]).sum(-1).float()
    torch.testing.assert_close(batch, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_the_8_bit_kernels_argmax_is_the_argmax_of_its_product(isa):
    """q8_matmul_argmax (a greedy step's lm_head) picks what argmax over q8_matmul's product
    picks: the first of equal maxima (duplicated weight rows tie exactly, across the threads'
    column ranges too), and never a padding column, though every real logit is negative and
    padding's are 0. Up to 25 rows: VNNI's argmax tiles take 12 rows where its product's take
    8, so 11, 13 and 25 rows end tiles of either at different rows."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(25, 128, generator=gen) + 1
    w = torch.randn(1000, 128, generator=gen) - 3  # every logit negative (~ -384 +- 40)
    codes = Q8Rows.quantize(w)
    assert codes.codes.shape[0] == 1008  # 8 padding rows
    for rows in (1, 3, 11, 13, 25):
        y = q8_matmul(x[:rows], codes, isa)
        assert (y < 0).all()
        assert torch.equal(q8_matmul_argmax(x[:rows], codes, isa), y.argmax(-1))
    w = torch.randn(1000, 128, generator=gen)
    w[3] *= 4
    w[700] = w[999] = w[3]  # equal sums in column 3, 700 and 999 for any input
    codes = Q8Rows.quantize(w)
    x = torch.cat([w[3:4], torch.randn(4, 128, generator=gen)])
    y = q8_matmul(x, codes, isa)
    assert y[0, 3] == y[0, 700] == y[0, 999] == y[0].max()
    tokens = q8_matmul_argmax(x, codes, isa)
    assert tokens[0].item() == 3 and torch.equal(tokens, y.argmax(-1))


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_the_8_bit_kernels_argmax_skips_nan_columns_beside_the_largest(isa):
    """A NaN column (a NaN scale) is never picked, and does not hide the larger value in its
    own 16 columns: a vector max over a tile can carry the NaN on or drop a value beside it,
    and the tile is then wrongly passed over for an earlier, smaller best. One thread, so the
    earlier best is the same thread's."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 128, generator=gen)
    w = torch.randn(64, 128, generator=gen) * 0.05
    w[3], w[24] = x[0], 2 * x[0]  # row 0's best so far in group 0, its largest in group 1
    blocks = w.view(64, 4, Q4_GROUP)
    scale = blocks.abs().amax(-1) / 127
    codes = (blocks / scale[..., None]).round().to(torch.int8).view(64, 128)
    # group 1, lane 0: vmaxps(lanes 8-15, lanes 0-7), as a reduction starts, keeps the NaN of
    # lane 0 and drops lane 8's largest value
    scale[16] = float("nan")
    codes = Q8Rows.from_row_codes(codes, scale)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y = q8_matmul(x, codes, isa)
        tokens = q8_matmul_argmax(x, codes, isa)
    finally:
        torch.set_num_threads(threads)
    assert y[:, 16].isnan().all() and y[0].nan_to_num(-1e30).argmax() == 24
    assert torch.equal(tokens, y.nan_to_num(nan=-float("inf")).argmax(-1))


def test_other_pairs_of_4_bit_parts_stay_4_bit():
    gen = torch.Generator().manual_seed(2)
    parts = [Q4Blocks(torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=gen),
                      torch.rand(16, 2, generator=gen), torch.zeros(16, 2)) for _ in range(2)]
    pair = Int4Weight.from_parts(parts)  # widened by "repeat", as Q5_K's two digits
    assert Q8Rows.from_pair(pair) is None
    assert isinstance(CodesLinear(pair, 2).rows[0], Q4Rows)


def test_a_wrong_width_is_refused():
    with pytest.raises(ValueError, match="input width 32 does not match the weight's 64"):
        q4_matmul(torch.randn(1, 32), random_rows(16, 64))


def test_codes_linear_runs_small_forwards_on_the_kernel_and_wide_ones_on_scratch():
    raw, exact = quantized("Q4_1", rows=64, cols=128)
    weight = int4(raw, "Q4_1", exact.shape)
    assert codes_linear_ok(weight)
    layer = CodesLinear(weight, 2)
    torch.testing.assert_close(layer.weight, exact, rtol=0, atol=2e-6 * exact.abs().max().item())
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 128, generator=gen)
        y = layer(x)
        reference = x @ exact.t()
        if rows <= 2:  # the kernel's int8 input costs well under 1% of the norm
            assert torch.equal(y, q4_matmul(x, layer.rows[0])), rows
            assert ((y - reference).norm() / reference.norm()).item() < 0.01, rows
        else:  # the file's weights in fp32: rounding only
            assert torch.equal(y, scratch_matmul(x, layer.rows[0])), rows
            torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_the_dequantizing_kernel_gives_the_kernels_weights(type_name):
    raw, exact = quantized(type_name, rows=48, cols=96)
    rows = CodesLinear(int4(raw, type_name, exact.shape), 1).rows[0]
    assert isinstance(rows, Q8Rows if type_name == "Q8_0" else Q4Rows)
    out = torch.full((7, 96), float("nan"))
    dequantize_rows(rows, 30, out[:5])  # output rows 30..34 only
    assert out[5:].isnan().all()
    if type_name == "Q8_0":  # q d, as gguf computes it
        assert torch.equal(out[:5], exact[30:35])
    else:  # q s + m in one rounding (fma) against torch's two: at most an ulp apart
        torch.testing.assert_close(out[:5], rows.dequantize()[30:35], rtol=2e-7, atol=1e-9)
        torch.testing.assert_close(out[:5], exact[30:35], rtol=0, atol=2e-6)


def test_a_wide_forward_dequantizes_in_pieces_when_the_weight_outgrows_the_scratch(monkeypatch):
    rows = random_rows(112, 64, seed=4)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    whole = scratch_matmul(x, rows)
    torch.testing.assert_close(whole, x @ rows.dequantize().t(), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(cpu_q4_kernel, "SCRATCH_FLOATS", 64 * 30)  # pieces of 30, 30, 30, 22
    monkeypatch.setattr(cpu_q4_kernel._scratch, "buf", None)
    pieces = scratch_matmul(x, rows)
    assert cpu_q4_kernel._scratch.buf.numel() == 64 * 30
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-7)


def test_a_bf16_wide_forward_rounds_as_a_bf16_gemm_and_returns_fp32(monkeypatch):
    rows = random_rows(112, 64, seed=5)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(7))
    reference = (x.bfloat16() @ rows.dequantize().bfloat16().t()).float()
    monkeypatch.setattr(cpu_q4_kernel, "SCRATCH_FLOATS", 64 * 30)  # in pieces too
    monkeypatch.setattr(cpu_q4_kernel._scratch, "buf", None, raising=False)
    monkeypatch.setattr(cpu_q4_kernel._scratch, "half", None, raising=False)
    y = scratch_matmul(x, rows, bf16=True)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, reference, rtol=1e-2, atol=1e-2)  # bf16's own rounding
    exact = x @ rows.dequantize().t()
    assert not torch.equal(y, exact)  # it did multiply in bf16
    torch.testing.assert_close(y, exact, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_scratch_made_in_inference_mode_serves_calls_outside_it(monkeypatch, bf16):
    """The worker's forwards run in inference mode, tests and tools outside it: a scratch
    buffer first made inside must not refuse the in-place writes of a later call outside."""
    for name in ("buf", "half"):
        monkeypatch.setattr(cpu_q4_kernel._scratch, name, None, raising=False)
    rows = random_rows(112, 64, seed=8)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        inside = scratch_matmul(x, rows, bf16=bf16)
    assert torch.equal(scratch_matmul(x, rows, bf16=bf16), inside)


def test_an_embedding_kept_as_q8_0_codes_looks_up_the_files_rows():
    raw, exact = quantized("Q8_0", rows=50, cols=64)
    codes = Q8Rows.from_pair(int4(raw, "Q8_0", exact.shape))
    ids = torch.tensor([[3, 0], [49, 3]])
    assert torch.equal(codes.lookup(ids), exact[ids])
    assert torch.equal(q8_lookup(codes, ids), exact[ids])  # the C lookup a decode step uses
    assert q8_lookup(codes, torch.tensor([], dtype=torch.int64)).shape == (0, 64)
    for bad in (50, -1):
        with pytest.raises(IndexError, match="outside the embedding table's 50 rows"):
            q8_lookup(codes, torch.tensor([2, bad]))


def test_the_c_lookup_reads_q6_k_halves_and_fp32_scales():
    weight, exact = q6_k_weight(40, 512, seed=4)
    codes = Q8Rows.from_digits16(weight)
    assert codes.halves == 2
    ids = torch.tensor([39, 0, 17, 17])
    assert torch.equal(q8_lookup(codes, ids), codes.lookup(ids))
    torch.testing.assert_close(q8_lookup(codes, ids), exact[ids], rtol=1e-6, atol=1e-6)
    own = Q8Rows.quantize(exact)  # fp32 scales, as a draft head's codes
    assert torch.equal(q8_lookup(own, ids), own.lookup(ids))


@pytest.mark.parametrize("rows", [15, 11])  # VNNI tiles 8 + 7 and 8 + 3
@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_every_build_of_the_4_bit_kernel_gives_each_row_alone_what_it_gives_it_in_a_batch(
        isa, rows):
    """The kernel's loops (AVX-512 VNNI where the CPU has it, AVX2, plain C; the last two built
    here without the newer instructions) take rows in tiles (of up to 8 rows with VNNI, 2 with
    AVX2, 1 in C): a row's result must not depend on the tile it lands in, and every build must
    compute the written-out sum."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    w = random_rows(48, 576, seed=3)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(15))
    batch = q4_matmul(x, w, isa)
    for i in range(rows):
        assert torch.equal(q4_matmul(x[i:i + 1], w, isa)[0], batch[i]), i
    torch.testing.assert_close(batch, emulated(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_every_build_sums_the_largest_codes_and_inputs_exactly(isa):
    """Codes of 15 against a block of inputs at +-127 after quantizing: the largest sums a block
    can have (AVX2 adds a block's int16 pairs before widening them: 8 x 3,810 = 30,480 must not
    wrap), with both signs and a block that mixes them, in every build."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    codes = torch.full((32, 128), 15, dtype=torch.uint8)
    codes[16:, 64:] = 0  # other rows: the smallest codes
    ones = torch.ones(32, 128 // Q4_GROUP)
    w = Q4Rows.from_weight(Int4Weight(Q4Blocks(codes, ones, torch.zeros_like(ones)), 128))
    x = torch.full((3, 128), 127.0)  # each block's scale exactly 1, its codes 127
    x[1] = -127
    x[2, ::2] = -127
    y = q4_matmul(x, w, isa)
    assert torch.equal(y, emulated(x, w))
    assert torch.equal(y, x @ w.dequantize().t())  # integers under 2^24: exact in fp32


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_every_build_sums_q6_k_s_largest_codes_exactly(isa):
    """Q6_K's codes (-32..31) with a scale every 16 inputs: AVX2 adds a half's 4 steps of int16
    pairs before widening them (4 x 2 x 32 x 127 = 32,512); codes of -32 against inputs at
    +-127 are the largest sums, and a whole block (8 steps) would wrap."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    codes = torch.full((16, 128), -32, dtype=torch.int8)
    codes[8:, ::3] = 31
    codes_form = Q8Rows.from_row_codes(codes, torch.ones(16, 128 // 16))
    assert codes_form.halves == 2
    x = torch.full((3, 128), 127.0)
    x[1] = -127
    x[2, ::2] = -127
    y = q8_matmul(x, codes_form, isa)
    assert torch.equal(y, x @ codes_form.dequantize().t())  # integers under 2^24: exact


def test_q5_0_codes_are_narrow_and_q8_0_or_q6_k_codes_are_not():
    """`narrow` (every code within +-16) lets AVX2 sum a block in int16: a Q5_0 weight's codes
    (-16..15) are, a Q8_0's (each block reaches +-127) and a Q6_K's (two scales) are not."""
    import numpy as np
    from gguf.quants import dequantize

    from gpu.loader.gguf_q4 import q5_as_q4_pair
    from tests.gpu.kquant_models import T, random_blocks
    raw = random_blocks(T.Q5_0, 32, 64, np.random.default_rng(4))
    q5 = Q8Rows.from_pair(Int4Weight.from_parts(q5_as_q4_pair(raw, "Q5_0", 32, 64)))
    assert q5.narrow
    assert torch.equal(q5.dequantize(), torch.from_numpy(dequantize(raw, T.Q5_0).reshape(32, 64)))
    raw, exact = quantized("Q8_0", rows=32, cols=64)
    assert not Q8Rows.from_pair(int4(raw, "Q8_0", exact.shape)).narrow
    assert not Q8Rows.from_row_codes(torch.full((16, 64), -17, dtype=torch.int8),
                                     torch.ones(16, 2)).narrow
    assert not Q8Rows.from_row_codes(torch.zeros(16, 64, dtype=torch.int8),
                                     torch.ones(16, 4)).narrow  # halves 2


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_every_build_sums_narrow_and_full_range_codes_exactly_at_their_largest(isa):
    """Codes of -16 (narrow: AVX2 adds a block's 8 steps in int16, 8 x 2 x 16 x 127 = 32,512)
    and of -128 (full range: one step's pair can reach 32,512, so they widen every step)
    against inputs at +-127: the largest sums each can have, exact in every build."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    x = torch.full((3, 128), 127.0)  # each block's scale exactly 1, its codes 127
    x[1] = -127
    x[2, ::2] = -127
    for low, narrow in ((-16, True), (-128, False)):
        codes = torch.full((16, 128), low, dtype=torch.int8)
        codes[8:, ::3] = -low - 1
        form = Q8Rows.from_row_codes(codes, torch.ones(16, 128 // Q4_GROUP))
        assert form.narrow == narrow
        assert torch.equal(q8_matmul(x, form, isa), x @ form.dequantize().t()), low


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_every_build_quantizes_the_input_to_the_same_bytes(isa):
    """The input's int8 codes and scales, the vector loops' and the plain C loop's, against the
    written-out rounding: ties to even (a block whose largest value is 127 scales by exactly 1,
    so 2.5 and -3.5 are ties), an all-zero block, and enough rows to be shared among threads."""
    import ctypes
    lib = cpu_q4_kernel.library(isa)
    if lib is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    rows, width = 40, 576
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(7)) * 3
    x[0, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [4.0] * 26)
    x[1, 32:64] = 0.0
    codes, scale = int8_input(x)
    lib.quantize_input.restype = ctypes.c_void_p
    lib.quantize_input.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                   ctypes.POINTER(ctypes.c_void_p),
                                   ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    x8_at, sums_at = ctypes.c_void_p(), ctypes.c_void_p()
    d_at = lib.quantize_input(x.data_ptr(), rows, width, ctypes.byref(x8_at),
                              ctypes.byref(sums_at), 2)
    try:
        blocks = rows * width // Q4_GROUP
        d = torch.frombuffer((ctypes.c_float * blocks).from_address(d_at), dtype=torch.float32)
        dsum = torch.frombuffer((ctypes.c_float * blocks).from_address(d_at + 4 * blocks),
                                dtype=torch.float32)
        x8 = torch.frombuffer((ctypes.c_int8 * (rows * width)).from_address(x8_at.value),
                              dtype=torch.int8)
        assert torch.equal(x8.view(rows, -1, Q4_GROUP), codes.to(torch.int8))
        assert torch.equal(d.view(rows, -1), scale)
        assert torch.equal(dsum.view(rows, -1), scale * codes.sum(-1))
        sums = torch.frombuffer((ctypes.c_int32 * blocks).from_address(sums_at.value),
                                dtype=torch.int32)
        assert torch.equal(sums.view(rows, -1), codes.sum(-1).to(torch.int32))
        assert x8[:6].tolist() == [127, 2, -4, 0, 0, 2]
    finally:
        ctypes.CDLL(None).free(ctypes.c_void_p(d_at))


def test_the_kernels_form_interleaves_16_rows_and_gives_them_back_in_order():
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(4))
    scale, zero = torch.rand(32, 2), torch.rand(32, 2)
    rows = Q4Rows.from_weight(Int4Weight(Q4Blocks(codes, scale, zero), 64))
    assert torch.equal(rows.codes(), codes)
    assert torch.equal(rows.row_params()[0], scale)
    # row 9's first 4 inputs sit in the high nibbles of the first step's bytes 4..7
    assert torch.equal(rows.nibbles.view(-1)[4:8] >> 4, codes[9, :4])
    assert torch.equal(rows.nibbles.view(-1)[4:8] & 0x0F, codes[1, :4])


def test_a_weight_of_rows_not_a_multiple_of_16_stays_off_the_kernel():
    blocks = Q4Blocks(torch.zeros(40, 64, dtype=torch.uint8), torch.ones(40, 2),
                      torch.zeros(40, 2))
    assert not codes_linear_ok(Int4Weight(blocks, 64))
    with pytest.raises(ValueError, match="multiple of 16 rows; this one has 40"):
        Q4Rows.from_weight(Int4Weight(blocks, 64))


def q6_k_weight(rows: int, cols: int, seed: int) -> tuple[Int4Weight, torch.Tensor]:
    """A Q6_K weight of random real blocks as the loader keeps it, and gguf's dequantize."""
    import numpy as np
    from gguf.quants import dequantize

    from gpu.loader.gguf_kquants import kquant_weight
    from tests.gpu.kquant_models import T, random_blocks
    raw = random_blocks(T.Q6_K, rows, cols, np.random.default_rng(seed))
    exact = torch.from_numpy(dequantize(raw, T.Q6_K).reshape(rows, cols))
    return kquant_weight(raw, "Q6_K", rows, cols), exact


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_a_q6_k_weight_runs_on_the_8_bit_kernel_with_a_scale_every_16_inputs(isa):
    """Q6_K's codes q - 32 are int8 codes exactly and its scales change every 16 inputs: the
    8-bit kernel with two scales a block gives gguf's weights bit for bit, each row alone what
    it gives it in a batch, and the written-out sums of each half block (the input quantized
    per 32 as always). 40 rows: the last 8 of 48 padding."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    weight, exact = q6_k_weight(40, 512, seed=3)
    assert codes_linear_ok(weight)
    codes = Q8Rows.from_digits16(weight)
    assert codes.halves == 2 and codes.codes.dtype == torch.int8 and codes.out == 40
    assert codes.row_codes().min() >= -32 and codes.row_codes().max() <= 31
    assert torch.equal(codes.dequantize(), exact)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(9))  # VNNI tiles 8, 3
    batch = q8_matmul(x, codes, isa)
    for i in range(11):
        assert torch.equal(q8_matmul(x[i:i + 1], codes, isa)[0], batch[i]), i
    x8, d = int8_input(x)
    halves = x8.double().view(11, -1, 16)  # [rows, 16-input halves, 16]
    dots = torch.einsum("ohj,rhj->roh", codes.row_codes().double().view(40, -1, 16), halves)
    scaled = dots * codes.row_scale().double()[None] * d.double().repeat_interleave(2, 1)[:, None]
    torch.testing.assert_close(batch, scaled.sum(-1).float(), rtol=1e-5, atol=1e-5)
    exact_y = x @ exact.t()
    assert ((batch - exact_y).norm() / exact_y.norm()).item() < 0.01
    wide = torch.randn(25, 512, generator=torch.Generator().manual_seed(10))  # argmax: 12 + 12 + 1
    assert torch.equal(q8_matmul_argmax(wide, codes, isa), q8_matmul(wide, codes, isa).argmax(-1))
    out = torch.empty(40, 512)
    dequantize_rows(codes, 0, out)
    assert torch.equal(out, exact)


def test_codes_linear_keeps_a_q6_k_weight_as_int8_codes_for_small_and_wide_forwards():
    weight, exact = q6_k_weight(48, 256, seed=4)
    layer = CodesLinear(weight, 4)
    assert isinstance(layer.rows[0], Q8Rows) and layer.rows[0].halves == 2
    assert torch.equal(layer.weight, exact)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    assert torch.equal(layer(x), q8_matmul(x, layer.rows[0]))
    wide = torch.randn(9, 256, generator=torch.Generator().manual_seed(7))  # above 4 rows
    torch.testing.assert_close(layer(wide), wide @ exact.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q6_K"])
def test_torch_compile_traces_the_kernel_as_one_op(type_name):
    if type_name == "Q6_K":
        layer = CodesLinear(q6_k_weight(64, 256, seed=5)[0], 4)
    else:
        raw, exact = quantized(type_name, rows=64, cols=128)
        layer = CodesLinear(int4(raw, type_name, exact.shape), 4)
    x = torch.randn(1, layer.in_features)

    def step(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(layer(h)) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), step(x))


def test_the_build_runs_the_widest_loop_the_cpu_has():
    """-march=native picks the loop: AVX-512 VNNI where the CPU has it (with AVX-512 BW), else
    AVX2, else plain C; the "avx2" and "c" builds never run the newer ones."""
    flags = set(c_library._cpu_flags().split())
    expected = ("avx512-vnni" if {"avx512_vnni", "avx512bw"} <= flags
                else "avx2" if "avx2" in flags else "c")
    assert c_library.kernel_isa() == expected
    for isa in ("avx2", "c"):
        if c_library.library(isa) is not None:
            assert c_library.kernel_isa(isa) == ("c" if isa == "c" or "avx2" not in flags
                                                 else "avx2")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_q4_0_and_q4_1_codes_keep_the_files_fp16_scales(type_name):
    """Their scales and minimums are fp16 in the file, so the kernel's form keeps them so:
    2 + 2 bytes a block of 32 instead of 4 + 4, the same weights."""
    raw, exact = quantized(type_name, rows=48, cols=96)
    weight = int4(raw, type_name, exact.shape)
    rows_form = Q4Rows.from_weight(weight)
    assert rows_form.fp16 and rows_form.minimum.dtype == torch.float16
    kept = sum(t.numel() * t.element_size()
               for t in (rows_form.nibbles, rows_form.scale, rows_form.minimum))
    assert kept == 48 * 96 // 32 * 20  # 16 bytes of codes and 2 + 2 of parameters a block
    got = weight.shape.fold(rows_form.dequantize())
    torch.testing.assert_close(got, exact, rtol=0, atol=2e-6 * exact.abs().max().item())


def test_parameters_fp16_cannot_hold_stay_fp32():
    w = random_rows(32, 64)  # random fp32 scales: not fp16 values
    assert not w.fp16 and w.scale.dtype == torch.float32


def half_exact_rows(out: int, width: int) -> Q4Rows:
    """Random codes whose scales and minimums are fp16 values, among them zeros, negative
    minimums and subnormals (the plain C build converts those itself)."""
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (out, width), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(out, width // Q4_GROUP, generator=gen) * 0.02).half().float()
    minimum = ((torch.rand(out, width // Q4_GROUP, generator=gen) - 0.5) * 0.1).half().float()
    scale[0, :4] = torch.tensor([0.0, 2.0 ** -24, 3 * 2.0 ** -20, 6.1e-5]).half().float()
    minimum[1, :3] = torch.tensor([0.0, -(2.0 ** -24), -5 * 2.0 ** -19]).half().float()
    zero = minimum.double() + 8 * scale.double()  # (q - 8) s + z = q s + minimum
    rows = Q4Rows.from_weight(Int4Weight(Q4Blocks(codes, scale, zero.float()), width))
    assert rows.fp16, "the test's parameters should be fp16 values"
    return rows


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_every_build_multiplies_fp16_parameters_as_the_same_values_in_fp32(isa):
    """Each build reads fp16 scales and minimums (F16C's conversion, or the C build's own) as
    exactly the fp32 values it reads otherwise: the same bits out, product and dequantization."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    half = half_exact_rows(48, 576)
    full = Q4Rows(half.nibbles, half.scale.float(), half.minimum.float())
    assert not full.fp16
    for rows in (1, 3, 11):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(q4_matmul(x, half, isa), q4_matmul(x, full, isa)), rows
    if isa == "native":  # dequantize_rows runs the native build
        a, b = torch.empty(9, 576), torch.empty(9, 576)
        dequantize_rows(half, 20, a)
        dequantize_rows(full, 20, b)
        assert torch.equal(a, b)
        torch.testing.assert_close(a, half.dequantize()[20:29], rtol=2e-7, atol=1e-9)


def test_q8_0_codes_keep_the_files_fp16_scales_and_a_quantized_head_keeps_fp32():
    raw, exact = quantized("Q8_0", rows=48, cols=96)
    codes = Q8Rows.from_pair(int4(raw, "Q8_0", exact.shape))
    assert codes.fp16
    assert codes.codes.numel() + codes.scale.numel() * 2 == 48 * 96 // 32 * 34  # the file's
    assert torch.equal(codes.dequantize(), exact)
    ids = torch.tensor([[3, 0], [47, 3]])
    assert torch.equal(codes.lookup(ids), exact[ids])
    assert not Q8Rows.quantize(exact).fp16  # scales of its own: max |w| / 127 in fp32


@pytest.mark.parametrize("isa", ["native", "avx2", "c"])
def test_every_build_multiplies_fp16_8_bit_scales_as_the_same_values_in_fp32(isa):
    """The 8-bit kernel converts a group's fp16 scales before its tiles run: product, argmax
    and dequantization give the same bits as with the same scales in fp32."""
    if cpu_q4_kernel.library(isa) is None:
        pytest.skip(f"the {isa} build of the kernel does not compile here")
    gen = torch.Generator().manual_seed(11)
    row_codes = torch.randint(-128, 128, (72, 576), dtype=torch.int8, generator=gen)
    scale = (torch.rand(72, 576 // Q4_GROUP, generator=gen) * 0.01).half().float()
    scale[0, :3] = torch.tensor([0.0, 2.0 ** -24, 3 * 2.0 ** -18])  # zero and subnormals
    half = Q8Rows.from_row_codes(row_codes, scale, file_scales=True)
    full = Q8Rows.from_row_codes(row_codes, scale)
    assert half.fp16 and not full.fp16 and half.out == 72  # 72 rows: 8 of padding
    for rows in (1, 3, 11):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(q8_matmul(x, half, isa), q8_matmul(x, full, isa)), rows
        assert torch.equal(q8_matmul_argmax(x, half, isa), q8_matmul_argmax(x, full, isa))
    if isa == "native":
        a, b = torch.empty(5, 576), torch.empty(5, 576)
        dequantize_rows(half, 60, a)
        dequantize_rows(full, 60, b)
        assert torch.equal(a, b) and torch.equal(a, half.dequantize()[60:65])
