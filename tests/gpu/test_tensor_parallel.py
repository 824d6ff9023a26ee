"""Tensor parallelism's pieces: int4 weights cut without dequantizing, the head split, and a
two-rank model (real processes, gloo) against the one-rank model on the same weights."""

from __future__ import annotations


import pytest
import torch
import torch.multiprocessing as mp

from gpu.int4_split import input_columns, output_rows
from gpu.loader.gguf_q4 import Int4Weight, Q4Blocks
from gpu.q4_linear import Q4Linear, q4_kernel_available
from gpu.tensor_parallel import split_heads
from tests.gpu import family_models as fm
from tests.gpu import tp_rank_runs
from tests.gpu.kquant_models import write_kquant_llama
from tests.ports import free_port
from tests.gpu.test_worker_process import tiny_plans


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    pass


def random_int4(out: int, width: int, in_features: int, widening: str) -> Int4Weight:
    g = torch.Generator().manual_seed(out + width)
    codes = torch.randint(0, 16, (out, width), generator=g, dtype=torch.uint8)
    scale = torch.rand(out, width // 32, generator=g) * 0.1
    zero = torch.randn(out, width // 32, generator=g) * 0.01
    return Int4Weight(Q4Blocks(codes, scale, zero), in_features, widening)


WIDENINGS = [("none", 1), ("repeat", 2), ("digits16", 2)]  # (widening, width / in_features)


@pytest.mark.parametrize("widening,factor", WIDENINGS)
def test_int4_cut_by_rows_and_by_input_groups_is_the_dequantized_cut(widening, factor):
    w = random_int4(48, 128 * factor, 128, widening)
    full = w.dequantize()
    rows = torch.tensor([0, 5, 17, 40, 47])
    assert torch.equal(output_rows(w, rows).dequantize(), full[rows])
    for start, stop in ((0, 64), (64, 128), (32, 96)):
        part = input_columns(w, start, stop)
        assert part.in_features == stop - start
        assert torch.equal(part.dequantize(), full[:, start:stop])
    # A cut inside a quantization group cannot be made on the codes: the caller dequantizes.
    assert input_columns(w, 0, 8 if widening == "digits16" else 16) is None


@pytest.mark.skipif(not q4_kernel_available(), reason="torch has no CPU int4 matmul")
def test_row_parallel_int4_partial_sums_add_up_on_the_kernel():
    w = random_int4(64, 256, 256, "none")
    x = torch.randn(3, 256).to(torch.bfloat16)
    whole = Q4Linear(w, 12)(x).float()
    halves = sum(Q4Linear(input_columns(w, a, a + 128), 12)(x[:, a:a + 128]).float()
                 for a in (0, 128))
    assert torch.allclose(halves, whole, atol=0.02 * whole.abs().max().item())


def test_heads_split_or_replicated_and_a_tp_that_cannot_split_them_refused():
    assert split_heads(8, 4, 2, 1) == split_heads(8, 4, 2, 1)
    assert split_heads(8, 4, 2, 1).kv_heads == (2, 3)  # split
    assert split_heads(8, 1, 2, 1).kv_heads == (0,)  # fewer KV heads than ranks: replicated
    assert split_heads(8, 2, 4, 3).kv_heads == (1,)
    assert split_heads(6, 3, 2, 0).kv_heads == (0, 0, 1)  # uneven: one per query head
    with pytest.raises(ValueError, match=r"parallel.tp = 2 must divide the model's 9 "
                                         r"attention heads.*one of 1, 3, 9"):
        split_heads(9, 3, 2, 0)



def two_ranks(tmp_path, model: str, dtype: str, plans) -> list[dict]:
    mp.spawn(tp_rank_runs.rank_main, args=(2, free_port(), model, dtype, plans, str(tmp_path)),
             nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["kv-split", "kv-replicated"])
def test_two_ranks_compute_the_one_rank_logits_and_tokens(tmp_path, kv_heads):
    # vocab 101: the last rank's share of the vocabulary is one row short (padded, cut off).
    model = fm.random_model("llama", vocab_size=101, hidden_size=256, intermediate_size=384,
                            num_attention_heads=8, num_key_value_heads=kv_heads,
                            bos_token_id=1, eos_token_id=2)
    path = str(fm.save_hf_dir(model, tmp_path / "model"))
    plans = tiny_plans()
    one = tp_rank_runs.run(path, "fp32", plans)
    ranks = two_ranks(tmp_path, path, "fp32", plans)
    for r in ranks:
        assert r["kv_heads"] == (2 if kv_heads == 4 else 1)
        assert r["logits"].shape == one["logits"].shape == (2, 101)
        torch.testing.assert_close(r["logits"], one["logits"], rtol=1e-4, atol=1e-4)
        assert r["tokens"] == one["tokens"]
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])  # the same gathered logits


@pytest.mark.skipif(not q4_kernel_available(), reason="torch has no CPU int4 matmul")
def test_two_ranks_keep_the_k_quants_as_int4(tmp_path):
    # Q4_K, Q5_K (widened "repeat") and Q6_K ("digits16") projections and a Q6_K lm_head, in
    # bf16 on the int4 kernel: each rank holds its cut of the codes, none dequantized.
    path = str(write_kquant_llama(tmp_path / "kq.gguf"))
    plans = tiny_plans()
    one = tp_rank_runs.run(path, "bf16", plans)
    ranks = two_ranks(tmp_path, path, "bf16", plans)
    assert one["q4_projections"] == 8
    for r in ranks:
        assert r["q4_projections"] == 8
        scale = one["logits"].abs().max().item()
        torch.testing.assert_close(r["logits"], one["logits"], rtol=0, atol=0.03 * scale)


def test_one_process_with_tp_above_one_says_where_ranks_come_from(tiny_llama):
    from gpu.worker import Worker
    from ipc.worker_config import worker_config

    with pytest.raises(ValueError, match=r"parallel.tp = 2 needs 2 ranks.*fmserve serve --tp 2"
                                         r".*offline engine"):
        Worker(worker_config(model_path=str(tiny_llama), tp=2, progress=False))
