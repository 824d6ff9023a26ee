"""Paged-attention test cases shared by the backends' tests: a pool with random contents,
requests in scattered slots on shuffled pages, the inputs of one forward, and a float64
reference computed request by request."""

from __future__ import annotations

import torch

from gpu.forward_batch import ForwardBatch, ForwardMode
from gpu.kv_cache import KVPool, ReqToTokenPool

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOST_ONLY_FIELDS = ("seq_lens_cpu", "prefix_lens_cpu", "extend_lens_cpu", "seq_lens_sum",
                    "max_seq_len", "max_extend_len")


class DeviceOnlyBatch(ForwardBatch):
    """A ForwardBatch whose host-side length fields explode when read: the Triton backend
    declares needs_cpu_seq_lens = False and must never look at them."""

    def __getattribute__(self, name: str):
        if name in HOST_ONLY_FIELDS:
            raise AssertionError(f"the Triton backend read batch.{name}")
        return super().__getattribute__(name)


def build_case(backend_cls, *, seq_lens: list[int], prefix_lens: list[int], page_size: int,
               num_heads: int, num_kv_heads: int, head_dim: int, pool_dtype: torch.dtype,
               q_dtype: torch.dtype, decode: bool, seed: int = 0,
               sliding_window: int | None = None):
    """A pool with random contents, requests in non-consecutive slots on shuffled pages, and
    the inputs of one forward that appends ``seq - prefix`` tokens to each request. A backend
    that declares needs_cpu_seq_lens gets the host lengths; one that does not gets a batch
    whose host fields explode when read."""
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

    fields = dict(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        positions=torch.cat(positions).to(DEVICE),
        slots=as_long(slots), seq_lens=as_long(seq_lens), prefix_lens=as_long(prefix_lens),
        extend_lens=as_long(extend_lens), out_cache_loc=torch.cat(rows).long(),
    )
    if backend_cls.needs_cpu_seq_lens:
        batch = ForwardBatch(**fields, seq_lens_cpu=torch.tensor(seq_lens),
                             prefix_lens_cpu=torch.tensor(prefix_lens),
                             extend_lens_cpu=torch.tensor(extend_lens),
                             seq_lens_sum=sum(seq_lens), max_seq_len=max(seq_lens),
                             max_extend_len=max(extend_lens))
    else:
        batch = DeviceOnlyBatch(**fields)
    backend = backend_cls(pool, table, num_heads, num_kv_heads, head_dim,
                          scale=head_dim ** -0.5, sliding_window=sliding_window)
    return backend, batch, q, k, v, layer_id


def reference_attention(backend, batch: ForwardBatch, q, k, v,
                        layer_id: int, k_before: torch.Tensor, v_before: torch.Tensor):
    """Per request, in float64: prefix K/V from the pool as it was before the forward, new
    K/V from the inputs (rounded to the pool dtype), kv heads repeated, causal softmax (over
    the last `backend.sliding_window` keys where set)."""
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
        key_pos = torch.arange(seq, device=q.device)[None, :]
        causal = key_pos <= query_pos
        if backend.sliding_window is not None:
            causal &= key_pos > query_pos - backend.sliding_window
        scores = scores.masked_fill(~causal, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += n_new
    return torch.cat(outs)


def run_and_compare(backend_cls, atol: float, **case) -> None:
    backend, batch, q, k, v, layer_id = build_case(backend_cls, **case)
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


