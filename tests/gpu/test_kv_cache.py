"""The KV pool on the CPU: zero, written where told, and resident only where used."""

import ctypes

import numpy as np
import pytest
import torch

from gpu.kv_cache import KVPool, ReqToTokenPool


def resident_bytes(buffer: torch.Tensor) -> int:
    """The resident bytes of the memory mappings that hold `buffer` (/proc/self/smaps; numpy's
    huge-page advice can split one allocation into several): the buffer's own pages, whatever
    other threads of the test process allocate meanwhile."""
    first = buffer.data_ptr()
    last = first + buffer.numel() * buffer.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < last and first < end
            elif inside and head == "Rss:":
                total += int(line.split()[1]) << 10
    return total


def test_a_fresh_pool_is_zero_and_costs_no_memory_until_written():
    # 4 layers of K and V, 64 MiB each: 512 MiB if the pool were written at allocation.
    pool = KVPool(4, num_pages=2048, page_size=16, num_kv_heads=8, head_dim=128,
                  dtype=torch.bfloat16, device="cpu")
    buffers = pool.k_buffer + pool.v_buffer
    total = sum(b.numel() * b.element_size() for b in buffers)
    assert total == 512 << 20
    resident = sum(resident_bytes(b) for b in buffers)
    assert resident < total // 8, f"a fresh pool holds {resident >> 20} MiB resident"
    assert all(b.dtype == torch.bfloat16 and b.is_contiguous() and not b.any()
               for b in buffers)
    buffers[0][:1024].fill_(1.0)  # written pages become resident: the measure can tell
    assert resident_bytes(buffers[0]) >= 1024 * 8 * 128 * 2


def test_writes_land_at_their_locations():
    pool = KVPool(2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8,
                  dtype=torch.float32, device="cpu")
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    loc = torch.tensor([5, 9, 14])
    pool.write(1, loc, k, v)
    assert torch.equal(pool.k_buffer[1][loc], k) and torch.equal(pool.v_buffer[1][loc], v)
    assert not pool.k_buffer[0].any() and pool.k_buffer[1].count_nonzero() == k.count_nonzero()


def test_a_pool_allocated_where_the_heap_has_a_free_block_is_not_resident_either():
    """calloc reuses a large free block of the heap and clears it by hand (resident); the pool
    maps memory of its own. The heap's mmap threshold is raised so that a freed 256 MiB block
    stays in the heap, as blocks freed after a model load do."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):
        pytest.skip("this C library has no mallopt")
    m_mmap_threshold = -3
    assert libc.mallopt(m_mmap_threshold, 1 << 30) == 1
    try:
        block = np.ones(256 << 20, dtype=np.uint8)  # in the heap, written: resident
        del block  # a free block the next large calloc would reuse
        pool = KVPool(2, num_pages=1024, page_size=16, num_kv_heads=8, head_dim=128,
                      dtype=torch.bfloat16, device="cpu")
        resident = sum(resident_bytes(b) for b in pool.k_buffer + pool.v_buffer)
        assert resident < 16 << 20, f"a fresh pool holds {resident >> 20} MiB resident"
        assert not any(b.any() for b in pool.k_buffer + pool.v_buffer)
    finally:
        libc.mallopt(m_mmap_threshold, 128 << 10)  # glibc's default threshold


def test_rope_tables_cover_the_positions_the_kv_cache_can_hold_and_no_more(tiny_llama):
    """The model's RoPE tables stop at the KV cache's tokens (plus a speculative step's
    reserve) where that is below the context limit: a request as long as the scheduler admits
    into the cache decodes as it does beside a cache of the whole context."""
    from fmserve.engine import Engine
    from ipc.sampling import SamplingParams
    small = Engine(model=str(tiny_llama), device="cpu", dtype="fp32", page_size=16,
                   max_kv_tokens=64, max_running_requests=1, progress=False)
    state = small.worker.state
    assert state.max_context_len > 64
    assert [rope.cos.shape[0] for rope in state.model.ropes] == [64 + state.cfg.spec.reserve_tokens]
    whole = Engine(model=str(tiny_llama), device="cpu", dtype="fp32", page_size=16,
                   max_kv_tokens=state.max_context_len, max_running_requests=1, progress=False)
    assert whole.worker.state.model.ropes[0].cos.shape[0] >= state.max_context_len
    prompt = [(5 * i + 1) % 90 for i in range(40)]  # the most the scheduler lets in
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    [a], [b] = small.generate([prompt], params), whole.generate([prompt], params)
    assert len(a.token_ids) == 8 and a.token_ids == b.token_ids


def test_a_steps_grants_in_one_scatter_map_what_each_grant_alone_maps():
    """grant_all (the worker's path, one scatter a step) fills req_to_token as grant_pages does
    grant by grant: later page indices of a slot, several slots, a grant cut at the context."""
    grants = [(1, 0, np.array([3, 7], dtype=np.int32)), (2, 0, np.array([5], dtype=np.int32)),
              (1, 2, np.array([9], dtype=np.int32)), (3, 2, np.array([2, 4, 6], dtype=np.int32))]
    one_by_one = ReqToTokenPool(num_slots=4, max_context_len=10, page_size=4, device="cpu")
    for slot, first, pages in grants:
        one_by_one.grant_pages(slot, first, torch.from_numpy(pages))
    together = ReqToTokenPool(num_slots=4, max_context_len=10, page_size=4, device="cpu")
    together.grant_all(grants)
    assert torch.equal(together.req_to_token, one_by_one.req_to_token)
    assert together.req_to_token[1].tolist() == [12, 13, 14, 15, 28, 29, 30, 31, 36, 37]
    assert together.req_to_token[3, 8:].tolist() == [8, 9]  # page 2 of slot 3: past the end
    assert not together.req_to_token[0].any()  # the padding slot stays untouched
    together.grant_all([])
    with pytest.raises(ValueError, match="slot 4 is outside 1..3"):
        together.grant_all([(4, 0, np.array([1], dtype=np.int32))])
