"""The dense fp32 kernel (gpu/dense_fp32.py, gpu/csrc/dense_fp32.c): its panels hold W
exactly, its products match float64 ones for every row count and ragged width, a row's result
does not depend on the rows beside it, and its torch op agrees with the direct call."""

from __future__ import annotations

import pytest
import torch

from gpu.c_library import available
from gpu.dense_fp32 import PANEL, pack_panels, panel_matmul, unpack_panels

pytestmark = pytest.mark.skipif(not available(), reason="needs a C compiler for gpu/csrc")

# (out, in): a width of whole panels, ragged ones (1, 15, 17 columns past a panel), one
# column, and an input shorter than a panel.
SHAPES = [(64, 48), (200, 24), (17, 33), (1, 40), (15, 7), (576, 576)]


def matrices(out: int, width: int, rows: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out, width, generator=gen),
            torch.randn(rows, width, generator=gen))


@pytest.mark.parametrize("shape", SHAPES)
def test_panels_hold_the_weight_exactly_and_pad_with_zeros(shape):
    weight, _ = matrices(*shape, rows=1)
    panels = pack_panels(weight)
    assert panels.shape == (-(-shape[0] // PANEL), shape[1], PANEL)
    assert torch.equal(unpack_panels(panels, shape[0]), weight)
    assert not panels.permute(0, 2, 1).reshape(-1, shape[1])[shape[0]:].any()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 40])
def test_products_match_float64_for_every_row_count(shape, rows):
    """Row counts 1-6 take one tile of 4 / 3 / 2 / 1 panels; more go 6 rows at a time."""
    weight, x = matrices(*shape, rows=rows, seed=rows)
    y = panel_matmul(x, pack_panels(weight), shape[0])
    want = x.double() @ weight.double().t()
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
    # fp32 sums over `in` products: a few units of fp32 rounding of the terms' magnitude
    bound = 8 * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().t())
    assert ((y.double() - want).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_is_the_same_in_any_batch(threads):
    """Batch-invariant: the same row alone, in 3 rows, or 9 (the path past one tile)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weight, x = matrices(576, 1536, rows=9, seed=3)
        panels = pack_panels(weight)
        alone = panel_matmul(x[4:5], panels, 576)
        for batch, row in ((x[2:5], 2), (x, 4), (x[4:9], 0)):  # x[4] in 3, 9 and 5 rows
            assert torch.equal(panel_matmul(batch, panels, 576)[row], alone[0])
    finally:
        torch.set_num_threads(before)


def test_the_torch_op_gives_the_direct_calls_result():
    weight, x = matrices(100, 64, rows=3)
    panels = pack_panels(weight)
    assert torch.equal(torch.ops.fmserve.dense_matmul(x, panels, 100),
                       panel_matmul(x, panels, 100))
    torch.library.opcheck(torch.ops.fmserve.dense_matmul, (x, panels, 100),
                          test_utils=("test_schema", "test_faketensor"))


def test_zero_rows_and_wrong_inputs():
    weight, x = matrices(20, 8, rows=2)
    panels = pack_panels(weight)
    assert panel_matmul(x[:0], panels, 20).shape == (0, 20)
    assert panel_matmul(x.t().contiguous().t(), panels, 20).shape == (2, 20)
    with pytest.raises(ValueError, match="fp32 rows of 8 inputs"):
        panel_matmul(x.double(), panels, 20)
    with pytest.raises(ValueError, match="fp32 rows of 8 inputs"):
        panel_matmul(torch.randn(2, 9), panels, 20)
    assert pack_panels(weight.to(torch.bfloat16)) is None


def test_an_owned_weight_is_packed_in_its_own_memory():
    weight, x = matrices(64, 48, rows=3)
    fresh = pack_panels(weight)
    given = weight.clone()
    panels = pack_panels(given, in_place=True)
    assert panels.data_ptr() == given.data_ptr() and torch.equal(panels, fresh)
    assert torch.equal(panel_matmul(x, panels, 64), panel_matmul(x, fresh, 64))


def test_a_weight_it_does_not_own_or_cannot_hold_is_copied_and_left_as_it_was():
    """A numpy array's memory (as a GGUF's F32 tensors map the file, read-only), a view into a
    larger tensor, and 17 columns (the padded panel needs more room): packed into new memory."""
    import numpy as np

    array = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)
    weight = torch.from_numpy(array)
    panels = pack_panels(weight, in_place=True)
    assert panels.data_ptr() != weight.data_ptr() and torch.equal(weight, torch.from_numpy(
        array.copy())) and torch.equal(unpack_panels(panels, 32), weight)
    base = torch.randn(64, 8)
    for weight in (base[16:48], torch.randn(17, 8)):
        before = weight.clone()
        panels = pack_panels(weight, in_place=True)
        assert torch.equal(weight, before) and torch.equal(
            unpack_panels(panels, weight.shape[0]), before)


def test_a_model_given_its_weights_packs_them_in_place_with_the_same_products(tiny_llama):
    from gpu.llama import LlamaModel
    from gpu.loader.load import load_model

    loaded = load_model(tiny_llama, dtype=torch.float32, progress=False)
    cpu = torch.device("cpu")
    kept = LlamaModel(loaded.config, loaded.weights, cpu, torch.float32)
    given = {name: w.clone() for name, w in loaded.weights.items()}
    memory = given["layers.0.gate_up_proj"].data_ptr()
    model = LlamaModel(loaded.config, given, cpu, torch.float32, consume_weights=True)
    assert "layers.0.gate_up_proj" not in given and "layers.0.gate_up_proj" in loaded.weights
    assert model.layers[0].gate_up_proj.panels.data_ptr() == memory
    x = torch.randn(3, loaded.config.hidden_size)
    for name in ("qkv_proj", "o_proj", "gate_up_proj"):
        mine, theirs = getattr(model.layers[1], name), getattr(kept.layers[1], name)
        rows = x if mine.in_features == x.shape[1] else torch.randn(3, mine.in_features)
        assert torch.equal(mine(rows), theirs(rows))
