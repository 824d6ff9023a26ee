"""The KV pool on the CPU: zero, written where told, and resident only where used."""

import psutil
import torch

from gpu.kv_cache import KVPool


def test_a_fresh_pool_is_zero_and_costs_no_memory_until_written():
    before = psutil.Process().memory_info().rss
    # 4 layers of K and V, 64 MiB each: 512 MiB if the pool were written at allocation.
    pool = KVPool(4, num_pages=2048, page_size=16, num_kv_heads=8, head_dim=128,
                  dtype=torch.bfloat16, device="cpu")
    grew = psutil.Process().memory_info().rss - before
    total = sum(b.numel() * b.element_size() for b in pool.k_buffer + pool.v_buffer)
    assert total == 512 << 20
    assert grew < total // 8, f"a fresh pool made the process {grew >> 20} MiB larger"
    assert all(b.dtype == torch.bfloat16 and b.is_contiguous() and not b.any()
               for b in pool.k_buffer + pool.v_buffer)


def test_writes_land_at_their_locations():
    pool = KVPool(2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8,
                  dtype=torch.float32, device="cpu")
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    loc = torch.tensor([5, 9, 14])
    pool.write(1, loc, k, v)
    assert torch.equal(pool.k_buffer[1][loc], k) and torch.equal(pool.v_buffer[1][loc], v)
    assert not pool.k_buffer[0].any() and pool.k_buffer[1].count_nonzero() == k.count_nonzero()
