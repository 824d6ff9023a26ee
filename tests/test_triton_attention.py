"""Triton paged attention (decode + extend) against a naive float64 reference.

Without a GPU the kernels run under the Triton interpreter on CPU tensors. ``triton.jit``
reads TRITON_INTERPRET when ``gpu.attention.triton_kernels`` is imported, so it is set here
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

from gpu.attention import triton_kernels  # noqa: E402
from gpu.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from gpu.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from gpu.kv_cache import KVPool, ReqToTokenPool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOST_ONLY_FIELDS = ("seq_lens_cpu", "prefix_lens_cpu", "extend_lens_cpu", "seq_lens_sum",
                    "max_seq_len", "max_extend_len")


def _kernels_for_this_device() -> None:
    if DEVICE.type == "cpu" and not triton_kernels.KERNELS_INTERPRETED:
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            pytest.skip("TRITON_INTERPRET is set to something other than 1 and there is no GPU")
        # Imported earlier (by another test module) as GPU kernels: rebuild them interpreted.
        importlib.reload(triton_kernels)


_kernels_for_this_device()


class DeviceOnlyBatch(ForwardBatch):
    """A ForwardBatch whose host-side length fields explode when read: the Triton backend
    declares needs_cpu_seq_lens = False and must never look at them."""

    def __getattribute__(self, name: str):
        if name in HOST_ONLY_FIELDS:
            raise AssertionError(f"the Triton backend read batch.{name}")
        return super().__getattribute__(name)


def build_case(*, seq_lens: list[int], prefix_lens: list[int], page_size: int, num_heads: int,
               num_kv_heads: int, head_dim: int, pool_dtype: torch.dtype,
               q_dtype: torch.dtype, decode: bool, seed: int = 0):
    """A pool with random contents, requests in non-consecutive slots on shuffled pages, and
    the inputs of one forward that appends ``seq - prefix`` tokens to each request."""
    gen = torch.Generator().manual_seed(seed)
    num_layers, layer_id = 2, 1
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + 3  # page 0 reserved, plus a little slack
    pool = KVPool(num_layers, num_pages, page_size, num_kv_heads, head_dim, pool_dtype, DEVICE)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(pool_dtype))
    table = ReqToTokenPool(num_slots=2 * len(seq_lens) + 2, max_context_len=max(seq_lens) + 16,
                           page_size=page_size, device=DEVICE)
    slots = [2 * i + 2 for i in range(len(seq_lens))][::-1]  # scattered, not in order
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).to(DEVICE)
    used = 0
    for slot, n in zip(slots, pages_per_req):
        table.grant_pages(slot, 0, pages[used:used + n])
        used += n

    extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
    num_tokens = sum(extend_lens)
    total_heads = num_heads + 2 * num_kv_heads
    # q as a view into a packed qkv projection, like the model produces it.
    qkv = torch.randn(num_tokens, total_heads * head_dim, generator=gen).to(q_dtype).to(DEVICE)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    rows = [table.req_to_token[s, p:n] for s, p, n in zip(slots, prefix_lens, seq_lens)]
    positions = [torch.arange(p, n) for p, n in zip(prefix_lens, seq_lens)]

    def as_long(values):
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    batch = DeviceOnlyBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        positions=torch.cat(positions).to(DEVICE),
        slots=as_long(slots), seq_lens=as_long(seq_lens), prefix_lens=as_long(prefix_lens),
        extend_lens=as_long(extend_lens), out_cache_loc=torch.cat(rows).long(),
    )
    backend = TritonAttentionBackend(pool, table, num_heads, num_kv_heads, head_dim,
                                     scale=head_dim ** -0.5)
    return backend, batch, q, k, v, layer_id


def reference_attention(backend: TritonAttentionBackend, batch: ForwardBatch, q, k, v,
                        layer_id: int, k_before: torch.Tensor, v_before: torch.Tensor):
    """Per request, in float64: prefix K/V from the pool as it was before the forward, new
    K/V from the inputs (rounded to the pool dtype), kv heads repeated, causal softmax."""
    group = backend.num_heads // backend.num_kv_heads
    pool_dtype = backend.kv_pool.dtype
    outs, start = [], 0
    for i in range(batch.batch_size):
        slot = int(batch.slots[i])
        prefix, seq = int(batch.prefix_lens[i]), int(batch.seq_lens[i])
        n_new = seq - prefix
        locs = backend.req_to_token.req_to_token[slot, :prefix].long()
        new = slice(start, start + n_new)
        keys = torch.cat([k_before[locs], k[new].to(pool_dtype)]).double()
        values = torch.cat([v_before[locs], v[new].to(pool_dtype)]).double()
        keys = keys.repeat_interleave(group, dim=1)  # [seq, H, D]
        values = values.repeat_interleave(group, dim=1)
        queries = q[new].double()  # [n_new, H, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * backend.scale
        query_pos = torch.arange(prefix, seq, device=q.device)[:, None]
        causal = torch.arange(seq, device=q.device)[None, :] <= query_pos
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += n_new
    return torch.cat(outs)


def run_and_compare(atol: float, **case) -> None:
    backend, batch, q, k, v, layer_id = build_case(**case)
    k_before = backend.kv_pool.k_buffer[layer_id].clone()
    v_before = backend.kv_pool.v_buffer[layer_id].clone()
    expected = reference_attention(backend, batch, q, k, v, layer_id, k_before, v_before)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer_id, batch)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)
    # The new k/v landed at out_cache_loc of this layer, the other layer is untouched.
    pool = backend.kv_pool
    torch.testing.assert_close(pool.k_buffer[layer_id][batch.out_cache_loc], k.to(pool.dtype))
    torch.testing.assert_close(pool.v_buffer[layer_id][batch.out_cache_loc], v.to(pool.dtype))


MIXED_LENS = [1, 7, 33, 130, 600]
SMOL = dict(num_heads=9, num_kv_heads=3, head_dim=64)  # the default model's attention shape
FP32 = dict(pool_dtype=torch.float32, q_dtype=torch.float32)
BF16 = dict(pool_dtype=torch.bfloat16, q_dtype=torch.bfloat16)


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
