"""The C decode step's attention (gpu/csrc/attention_ops.h `attend`, through the library's
`decode_attention`) against torch's softmax(q k^T) v on the same gathered keys and values.

It does the query heads of a kv head together, up to four at a time, so the cases cover every
count of heads at once (1-4), groups split into several passes (6 = 4 + 2, 7 = 4 + 3), key
counts that leave a tail after its blocks of four, a head_dim that leaves a partial block of
value dimensions (40 = 32 + 8), rows whose keys are scattered through the cache, and both cache
forms (fp32, and fp16 where the library reads it)."""

from __future__ import annotations

import pytest
import torch

from gpu import cpu_q4_kernel

pytestmark = pytest.mark.skipif(not cpu_q4_kernel.available(),
                                reason="the C kernel is not built here (no C compiler)")

LENGTHS = (1, 3, 4, 6, 17, 41)  # rows' key counts: below, at and between blocks of four
SHAPES = [  # heads, kv_heads, head_dim
    (4, 4, 64), (4, 2, 64), (9, 3, 64), (8, 2, 64), (14, 2, 64), (6, 1, 32), (3, 1, 40),
    (8, 2, 128), (4, 1, 256)]


def c_attention(lib, q, k_cache, v_cache, key_locs, seq_lens, kv_heads):
    rows, heads, dim = q.shape
    qkv = q.reshape(rows, heads * dim).contiguous()
    out = torch.empty(rows, heads * dim)
    status = lib.decode_attention(
        heads, kv_heads, dim, int(k_cache.dtype == torch.float16), dim ** -0.5,
        k_cache.data_ptr(), v_cache.data_ptr(), qkv.data_ptr(), heads * dim, rows,
        key_locs.data_ptr(), key_locs.shape[1], seq_lens.data_ptr(), out.data_ptr(), 2)
    assert status == 0
    return out.view(rows, heads, dim)


def torch_attention(q, k_cache, v_cache, key_locs, seq_lens):
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    outs = []
    for r, n in enumerate(seq_lens.tolist()):
        locs = key_locs[r, :n].long()
        k = k_cache[locs].float().repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, d]
        v = v_cache[locs].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r].double(), k.double()) * q.shape[-1] ** -0.5
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v.double()).float())
    return torch.stack(outs)


def library_for(isa: str, half: bool):
    lib = cpu_q4_kernel.library(isa)
    if half and not lib.kv_half_supported():
        pytest.skip("this CPU has no F16C: its C step keeps an fp32 cache")
    return lib


def attention_case(heads, kv_heads, dim, half, lengths, locations, seed):
    """Random caches (fp16 where `half`), each row's keys at scattered locations of the cache
    (the rest of its row unused), and the rows' queries: (q, k_cache, v_cache, key_locs,
    seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = torch.float16 if half else torch.float32
    k_cache = torch.randn(locations, kv_heads, dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(locations, kv_heads, dim, generator=gen).to(cache_dtype)
    key_locs = torch.full((len(lengths), max(lengths)), -1, dtype=torch.int32)
    for r, n in enumerate(lengths):
        key_locs[r, :n] = torch.randperm(locations, generator=gen)[:n].int()
    seq_lens = torch.tensor(lengths, dtype=torch.int64)
    q = torch.randn(len(lengths), heads, dim, generator=gen) * 2
    return q, k_cache, v_cache, key_locs, seq_lens


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("isa,half", [("native", False), ("native", True), ("avx2", False),
                                      ("avx2", True), ("c", False)])
def test_attention_matches_torch_for_every_grouping_of_heads(heads, kv_heads, dim, isa, half):
    """The library built for this CPU, without AVX-512 (16 vector registers), and in plain C
    (a CPU without AVX2 or F16C, whose C step keeps an fp32 cache)."""
    lib = library_for(isa, half)
    q, k_cache, v_cache, key_locs, seq_lens = attention_case(heads, kv_heads, dim, half,
                                                             LENGTHS, 256, heads * 100 + dim)
    ours = c_attention(lib, q, k_cache, v_cache, key_locs, seq_lens, kv_heads)
    theirs = torch_attention(q, k_cache, v_cache, key_locs, seq_lens)
    # fp32 sums in another order than the fp64 reference: ~1e-6; a key of another head or
    # row, or a head given another head's output, is off by order 1
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
@pytest.mark.parametrize("isa,half", [("native", True), ("avx2", False), ("c", False)])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(heads, kv_heads, dim, isa, half):
    """Fewer rows than twice the threads are shared out by kv head, more a thread a row: each
    row's output is bit for bit what it gets in a batch of six rows, alone or beside others
    (an EAGLE verify's rows and a plain step's row then agree), and matches torch."""
    lib = library_for(isa, half)
    lengths = (1, 5, 41, 130, 203, 64)  # below a block of four keys, tails after them, long rows
    q, k_cache, v_cache, key_locs, seq_lens = attention_case(heads, kv_heads, dim, half,
                                                             lengths, 512, heads * 10 + dim)
    batch = c_attention(lib, q, k_cache, v_cache, key_locs, seq_lens, kv_heads)
    for rows in ([0], [2], [3], [4], [1, 4], [2, 3, 5]):
        few = c_attention(lib, q[rows].contiguous(), k_cache, v_cache,
                          key_locs[rows].contiguous(), seq_lens[rows], kv_heads)
        assert torch.equal(few, batch[rows]), rows
        torch.testing.assert_close(few, torch_attention(q[rows], k_cache, v_cache,
                                                        key_locs[rows], seq_lens[rows]),
                                   rtol=1e-4, atol=1e-5)
