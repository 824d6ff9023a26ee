"""Triton paged attention (decode + extend) against a naive float64 reference.

Without a GPU the kernels run under the Triton interpreter on CPU tensors. ``triton.jit``
reads TRITON_INTERPRET when ``gpu.attention.triton_decode`` is imported, so it is set here
before that import; if another test module imported the kernels earlier without it, they are
reloaded (see ``_kernels_for_this_device``).
"""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from gpu.attention import triton_common, triton_decode, triton_extend  # noqa: E402
from gpu.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from gpu.forward_batch import ForwardMode  # noqa: E402
from tests.gpu import attention_cases as cases  # noqa: E402
from tests.gpu.attention_cases import (BF16, DEVICE, FP32, MIXED_LENS, SMOL,  # noqa: E402
                                   DeviceOnlyBatch)


def _kernels_for_this_device() -> None:
    if DEVICE.type == "cpu" and not triton_common.KERNELS_INTERPRETED:
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            pytest.skip("TRITON_INTERPRET is set to something other than 1 and there is no GPU")
        # Imported earlier (by another test module) as GPU kernels: rebuild them interpreted.
        for module in (triton_common, triton_decode, triton_extend):
            importlib.reload(module)


_kernels_for_this_device()


def build_case(**case):
    return cases.build_case(TritonAttentionBackend, **case)


def run_and_compare(atol: float, **case) -> None:
    cases.run_and_compare(TritonAttentionBackend, atol, **case)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_mixed_lengths_fp32(page_size):
    run_and_compare(1e-4, seq_lens=MIXED_LENS, prefix_lens=[n - 1 for n in MIXED_LENS],
                    page_size=page_size, decode=True, **SMOL, **FP32)


def test_decode_bf16_pool():
    run_and_compare(2e-2, seq_lens=MIXED_LENS, prefix_lens=[n - 1 for n in MIXED_LENS],
                    page_size=16, decode=True, **SMOL, **BF16)


def test_decode_fp32_queries_over_bf16_pool():
    lens = [5, 130]
    run_and_compare(2e-2, seq_lens=lens, prefix_lens=[n - 1 for n in lens], page_size=16,
                    decode=True, **SMOL, pool_dtype=torch.bfloat16, q_dtype=torch.float32)


def test_decode_head_dim_128_and_wide_group():
    # 20 query heads on 1 kv head: the group spans two head blocks of the decode kernel.
    lens = [3, 70, 260]
    run_and_compare(1e-4, seq_lens=lens, prefix_lens=[n - 1 for n in lens], page_size=16,
                    decode=True, num_heads=20, num_kv_heads=1, head_dim=128, **FP32)


def test_decode_batch_of_one():
    run_and_compare(1e-4, seq_lens=[600], prefix_lens=[599], page_size=1, decode=True,
                    **SMOL, **FP32)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_without_prefix_mixed_lengths(page_size):
    run_and_compare(1e-4, seq_lens=MIXED_LENS, prefix_lens=[0] * len(MIXED_LENS),
                    page_size=page_size, decode=False, **SMOL, **FP32)


def test_extend_without_prefix_bf16():
    lens = [1, 33, 130]
    run_and_compare(2e-2, seq_lens=lens, prefix_lens=[0] * len(lens), page_size=16,
                    decode=False, **SMOL, **BF16)


def test_extend_chunk_on_cached_prefix_batch_of_one():
    # Chunked prefill: 40 tokens cached, the next chunk of 25 attends to them and causally.
    run_and_compare(1e-4, seq_lens=[65], prefix_lens=[40], page_size=16, decode=False,
                    **SMOL, **FP32)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_mixed_prefixes_and_lengths(page_size):
    run_and_compare(1e-4, seq_lens=[65, 7, 170, 4, 131], prefix_lens=[40, 0, 100, 3, 2],
                    page_size=page_size, decode=False, **SMOL, **FP32)


def test_extend_head_dim_128_bf16_with_prefix():
    run_and_compare(2e-2, seq_lens=[65, 90], prefix_lens=[40, 0], page_size=16, decode=False,
                    num_heads=8, num_kv_heads=2, head_dim=128, **BF16)


def test_head_dim_not_a_power_of_two():
    # head_dim 80 runs in a 128-wide block with the tail masked off.
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=80)
    run_and_compare(1e-4, seq_lens=[45, 20], prefix_lens=[30, 0], page_size=16, decode=False,
                    **shape, **FP32)
    run_and_compare(1e-4, seq_lens=[45, 200], prefix_lens=[44, 199], page_size=16,
                    decode=True, **shape, **FP32)


@pytest.mark.parametrize("window", [1, 8, 100])
def test_sliding_window(window):
    # Decodes past the window (split over its keys only), extend blocks of 64 queries whose
    # windows start mid-block, a prompt shorter than the window.
    run_and_compare(1e-4, seq_lens=[301, 65, 140, 2, 33], prefix_lens=[300, 40, 0, 1, 32],
                    page_size=16, decode=False, sliding_window=window, **SMOL, **FP32)
    run_and_compare(1e-4, seq_lens=MIXED_LENS, prefix_lens=[n - 1 for n in MIXED_LENS],
                    page_size=16, decode=True, sliding_window=window, **SMOL, **FP32)


def test_idle_batch_returns_empty_without_launching():
    backend, _, _, _, _, layer_id = build_case(
        seq_lens=[4], prefix_lens=[0], page_size=16, decode=False, **SMOL, **FP32)
    empty_long = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    batch = DeviceOnlyBatch(mode=ForwardMode.IDLE, input_ids=empty_long, positions=empty_long,
                            slots=empty_long, seq_lens=empty_long, prefix_lens=empty_long,
                            extend_lens=empty_long, out_cache_loc=empty_long)
    k_before = backend.kv_pool.k_buffer[layer_id].clone()
    q = torch.zeros(0, 9, 64, device=DEVICE)
    kv = torch.zeros(0, 3, 64, device=DEVICE)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, kv, kv, layer_id, batch)
    assert out.shape == (0, 9, 64) and out.dtype == q.dtype
    assert torch.equal(backend.kv_pool.k_buffer[layer_id], k_before)


def test_backend_opts_out_of_host_lengths():
    assert TritonAttentionBackend.needs_cpu_seq_lens is False
    _, batch, *_ = build_case(seq_lens=[4], prefix_lens=[0], page_size=16, decode=False,
                              **SMOL, **FP32)
    with pytest.raises(AssertionError, match="seq_lens_cpu"):
        batch.seq_lens_cpu  # noqa: B018 - the guard every other test relies on works
