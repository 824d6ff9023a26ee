"""Tree attention (ForwardBatch.tree_mask) on both attention backends, against a float64
reference written here: per request and query, a softmax over exactly the visible keys.

Layouts covered: verification (Q == K, the queries are the whole tree) and drafting (Q < K,
the queries are one middle block of the K tree keys), prefixes of length 0 and not, page
sizes 1 and 16, K and Q above the extend kernel's 64-wide blocks. Without a GPU the Triton
kernels run under the interpreter (see tests/gpu/test_triton_attention.py for the reload dance).
Under a sliding window (a verify step on Mistral or Gemma 3's local layers) the reference
places every key at its position (prefix key i at i, tree key k at the tree's start plus its
depth) and keeps the last `window` positions up to the query's; the batch-invariant backend
(runtime.deterministic) joins the two others there.
"""

from __future__ import annotations

import importlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from gpu.attention import triton_common, triton_decode, triton_extend  # noqa: E402
from gpu.attention.batch_invariant_backend import BatchInvariantAttentionBackend  # noqa: E402
from gpu.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from gpu.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from gpu.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from gpu.kv_cache import KVPool, ReqToTokenPool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOST_ONLY_FIELDS = ("seq_lens_cpu", "prefix_lens_cpu", "extend_lens_cpu", "seq_lens_sum",
                    "max_seq_len", "max_extend_len")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32
LAYER = 1
ATOL = 1e-4

if DEVICE.type == "cpu" and not triton_common.KERNELS_INTERPRETED:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("TRITON_INTERPRET is set to something other than 1 and there is no GPU",
                    allow_module_level=True)
    # Imported earlier as GPU kernels: rebuild them interpreted.
    for module in (triton_common, triton_decode, triton_extend):
        importlib.reload(module)


class DeviceOnlyBatch(ForwardBatch):
    """Host-side length fields explode when read: the Triton backend must not need them."""

    def __getattribute__(self, name: str):
        if name in HOST_ONLY_FIELDS:
            raise AssertionError(f"the Triton backend read batch.{name}")
        return super().__getattribute__(name)


def ancestor_mask(num_nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] bool: node t sees itself and its ancestors in a random tree whose parents
    precede their children (node 0 the root)."""
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    mask[0, 0] = True
    for t in range(1, num_nodes):
        parent = int(torch.randint(0, t, (1,), generator=gen))
        mask[t] = mask[parent]
        mask[t, t] = True
    return mask


class Case:
    """A pool with random contents, requests in scattered slots on shuffled pages, each with
    ``prefix`` cached keys followed by K tree keys; the Q new tokens of request i are tree
    keys ``q_offset .. q_offset + Q - 1`` and get fresh random k/v."""

    def __init__(self, prefix_lens: list[int], num_k: int, num_q: int, q_offset: int,
                 page_size: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        assert q_offset + num_q <= num_k
        self.gen = gen
        self.prefix_lens = prefix_lens
        self.seq_lens = [p + num_k for p in prefix_lens]
        self.num_k, self.num_q, self.q_offset = num_k, num_q, q_offset
        bs = len(prefix_lens)
        pages_per_req = [-(-n // page_size) for n in self.seq_lens]
        num_pages = sum(pages_per_req) + 3
        self.pool = KVPool(2, num_pages, page_size, NUM_KV_HEADS, HEAD_DIM, torch.float32,
                           DEVICE)
        for buf in self.pool.k_buffer + self.pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=gen))
        self.table = ReqToTokenPool(num_slots=2 * bs + 2, max_context_len=max(self.seq_lens) + 8,
                                    page_size=page_size, device=DEVICE)
        self.slots = [2 * i + 2 for i in range(bs)][::-1]
        pages = (torch.randperm(num_pages - 1, generator=gen) + 1).to(DEVICE)
        used = 0
        for slot, n in zip(self.slots, pages_per_req):
            self.table.grant_pages(slot, 0, pages[used:used + n])
            used += n
        num_tokens = bs * num_q
        self.q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
        self.k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
        self.v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
        first_new = [p + q_offset for p in prefix_lens]
        self.out_cache_loc = torch.cat([self.table.req_to_token[s, f:f + num_q]
                                        for s, f in zip(self.slots, first_new)]).long()
        self.positions = torch.cat([torch.arange(f, f + num_q) for f in first_new]).to(DEVICE)
        self.k_snapshot = [b.clone() for b in self.pool.k_buffer]
        self.v_snapshot = [b.clone() for b in self.pool.v_buffer]

    def reset_pool(self) -> None:
        for buf, snap in zip(self.pool.k_buffer + self.pool.v_buffer,
                             self.k_snapshot + self.v_snapshot):
            buf.copy_(snap)

    def batch(self, tree_mask: torch.Tensor | None, *, device_only: bool) -> ForwardBatch:
        def as_long(values):
            return torch.tensor(values, dtype=torch.int64, device=DEVICE)

        bs = len(self.slots)
        fields = dict(
            mode=ForwardMode.EXTEND,
            input_ids=torch.zeros(bs * self.num_q, dtype=torch.int64, device=DEVICE),
            positions=self.positions, slots=as_long(self.slots),
            seq_lens=as_long(self.seq_lens),
            prefix_lens=as_long([s - self.num_k for s in self.seq_lens]),
            extend_lens=as_long([self.num_q] * bs), out_cache_loc=self.out_cache_loc,
            tree_mask=None if tree_mask is None else tree_mask.to(DEVICE),
        )
        if device_only:
            return DeviceOnlyBatch(**fields)
        return ForwardBatch(**fields, seq_lens_cpu=torch.tensor(self.seq_lens),
                            prefix_lens_cpu=torch.tensor([s - self.num_k for s in self.seq_lens]),
                            extend_lens_cpu=torch.tensor([self.num_q] * bs),
                            seq_lens_sum=sum(self.seq_lens), max_seq_len=max(self.seq_lens),
                            max_extend_len=self.num_q)

    def run(self, backend_name: str, tree_mask: torch.Tensor | None,
            window: int | None = None) -> torch.Tensor:
        """One forward on a fresh copy of the pool."""
        self.reset_pool()
        cls = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend,
               "batch_invariant": BatchInvariantAttentionBackend}[backend_name]
        backend = cls(self.pool, self.table, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                      scale=HEAD_DIM ** -0.5, sliding_window=window)
        batch = self.batch(tree_mask, device_only=backend_name == "triton")
        backend.init_forward_metadata(batch)
        out = backend.forward(self.q, self.k, self.v, LAYER, batch)
        assert out.shape == self.q.shape and out.dtype == self.q.dtype
        assert torch.equal(self.pool.k_buffer[LAYER][self.out_cache_loc], self.k)
        return out

    def reference(self, tree_mask: torch.Tensor, window: int | None = None,
                  depth: torch.Tensor | None = None) -> torch.Tensor:
        """Plain loops in float64 over the pool as the forward leaves it. With a window,
        `depth` [bs, K] places tree key k at tree_start + depth[k] (query j is tree key
        q_offset + j)."""
        keys_pool = self.k_snapshot[LAYER].clone()
        values_pool = self.v_snapshot[LAYER].clone()
        keys_pool[self.out_cache_loc] = self.k
        values_pool[self.out_cache_loc] = self.v
        group = NUM_HEADS // NUM_KV_HEADS
        out = torch.zeros(self.q.shape, dtype=torch.float64)
        for i, (slot, seq) in enumerate(zip(self.slots, self.seq_lens)):
            tree_start = seq - self.num_k
            locs = self.table.req_to_token[slot, :seq].long().cpu()
            for j in range(self.num_q):
                visible = [n for n in range(seq)
                           if n < tree_start or bool(tree_mask[i, j, n - tree_start])]
                if window is not None:
                    def position(n: int) -> int:
                        return n if n < tree_start else tree_start + int(depth[i, n - tree_start])
                    query_pos = position(tree_start + self.q_offset + j)
                    visible = [n for n in visible if query_pos - position(n) < window]
                assert visible, "every query row needs a visible key"
                idx = locs[visible]
                row = i * self.num_q + j
                for h in range(NUM_HEADS):
                    kh = h // group
                    keys = keys_pool[idx, kh].double().cpu()  # [n, D]
                    values = values_pool[idx, kh].double().cpu()
                    scores = keys @ self.q[row, h].double().cpu() * HEAD_DIM ** -0.5
                    out[row, h] = torch.softmax(scores, 0) @ values
        return out


def verification_masks(bs: int, num_k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([ancestor_mask(num_k, gen) for _ in range(bs)])


def drafting_masks(bs: int, num_k: int, num_q: int, q_offset: int, gen: torch.Generator
                   ) -> torch.Tensor:
    """Rows q_offset .. q_offset+Q-1 of random ancestor masks: the queries are a middle block
    of the tree's keys, later keys invisible."""
    return torch.stack([ancestor_mask(num_k, gen)[q_offset:q_offset + num_q]
                        for _ in range(bs)])


def random_masks(bs: int, num_k: int, num_q: int, q_offset: int, gen: torch.Generator
                 ) -> torch.Tensor:
    """Arbitrary masks (later keys too), sparse, each query seeing at least its own key."""
    mask = torch.rand(bs, num_q, num_k, generator=gen) < 0.2
    mask[:, torch.arange(num_q), q_offset + torch.arange(num_q)] = True
    return mask


BACKENDS = ["torch", "triton"]


def _check(case: Case, tree_mask: torch.Tensor, backends=BACKENDS) -> dict[str, torch.Tensor]:
    expected = case.reference(tree_mask)
    outs = {}
    for name in backends:
        out = case.run(name, tree_mask)
        torch.testing.assert_close(out.double().cpu(), expected, atol=ATOL, rtol=0,
                                   msg=lambda m, n=name: f"{n} backend: {m}")
        outs[name] = out
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_verification_tree(page_size):
    # Q == K: the whole tree is new. Prefixes 0, short and across pages.
    case = Case(prefix_lens=[0, 5, 37], num_k=12, num_q=12, q_offset=0, page_size=page_size,
                seed=page_size)
    _check(case, verification_masks(3, 12, case.gen))


@pytest.mark.parametrize("page_size", [1, 16])
def test_drafting_middle_block(page_size):
    # Tree drafting step 1 of 3: queries are tree keys 4..7 of 12.
    case = Case(prefix_lens=[21, 0, 3], num_k=12, num_q=4, q_offset=4, page_size=page_size,
                seed=10 + page_size)
    _check(case, drafting_masks(3, 12, 4, 4, case.gen))


def test_arbitrary_masks_and_later_keys():
    # Masks that also expose keys after the query block (the kernel must not assume any
    # ordering), on a prefix spanning several 64-key blocks.
    case = Case(prefix_lens=[130, 0], num_k=10, num_q=5, q_offset=2, page_size=16, seed=3)
    _check(case, random_masks(2, 10, 5, 2, case.gen))


def test_tree_wider_than_a_kernel_block():
    # K = Q = 80 > 64: two query blocks and two key steps over the tree. With prefix 0 and a
    # diagonal-only mask, rows >= 64 see nothing in the first key step (the kernel's
    # empty-row guard), rows < 64 nothing in the second.
    case = Case(prefix_lens=[0, 70], num_k=80, num_q=80, q_offset=0, page_size=16, seed=4)
    diag = torch.eye(80, dtype=torch.bool).expand(2, 80, 80).clone()
    _check(case, diag)
    _check(case, verification_masks(2, 80, case.gen))


@pytest.mark.parametrize("page_size", [1, 16])
def test_chain_mask_equals_causal_extend(page_size):
    # A chain (lower-triangular, Q == K) is ordinary causal attention over the new tokens.
    case = Case(prefix_lens=[0, 9, 40], num_k=7, num_q=7, q_offset=0, page_size=page_size,
                seed=20 + page_size)
    chain = torch.tril(torch.ones(7, 7, dtype=torch.bool)).expand(3, 7, 7).clone()
    for name in BACKENDS:
        tree_out = case.run(name, chain)
        causal_out = case.run(name, None)
        torch.testing.assert_close(tree_out, causal_out, atol=1e-5, rtol=0)
    _check(case, chain)


def test_wrong_mask_changes_output():
    # The comparison has teeth: hiding a single key from a single query moves that query's
    # output (and only that query's, on both backends).
    case = Case(prefix_lens=[3, 0], num_k=9, num_q=9, q_offset=0, page_size=1, seed=5)
    mask = verification_masks(2, 9, case.gen)
    row = int(mask[1].sum(1).argmax())  # a query that sees several tree keys
    hidden = int(mask[1, row].nonzero()[0])
    wrong = mask.clone()
    wrong[1, row, hidden] = False
    for name in BACKENDS:
        good, bad = case.run(name, mask), case.run(name, wrong)
        changed = ((good - bad).abs().amax(dim=(1, 2)) > 1e-3).nonzero().flatten().tolist()
        assert changed == [9 + row], f"{name}: rows {changed} changed"


WINDOWED_BACKENDS = ["torch", "triton", "batch_invariant"]


@pytest.mark.parametrize("window", [1, 3, 6])
def test_verification_tree_under_a_window(window):
    # Windows shorter than the tree's paths (they cut into the tree) and longer (they cut
    # into the prefix: prefixes 0, shorter than the window and longer).
    case = Case(prefix_lens=[0, 2, 37], num_k=12, num_q=12, q_offset=0, page_size=4,
                seed=30 + window)
    masks = verification_masks(3, 12, case.gen)
    depth = masks.sum(-1) - 1
    expected = case.reference(masks, window, depth)
    # The window hides keys the full tree shows: the comparison can fail.
    assert (expected - case.reference(masks)).abs().max() > 1e-2
    for name in WINDOWED_BACKENDS:
        out = case.run(name, masks, window)
        torch.testing.assert_close(out.double().cpu(), expected, atol=ATOL, rtol=0,
                                   msg=lambda m, n=name: f"{n} backend: {m}")


def test_drafting_block_under_a_window():
    # The draft loop's layout (queries a middle block of the tree's keys) under a window of 2.
    case = Case(prefix_lens=[21, 0, 3], num_k=12, num_q=4, q_offset=4, page_size=16, seed=40)
    full = verification_masks(3, 12, case.gen)
    masks = full[:, 4:8]
    expected = case.reference(masks, 2, full.sum(-1) - 1)
    for name in WINDOWED_BACKENDS:
        out = case.run(name, masks, 2)
        torch.testing.assert_close(out.double().cpu(), expected, atol=ATOL, rtol=0,
                                   msg=lambda m, n=name: f"{n} backend: {m}")


def test_chain_under_a_window_equals_windowed_causal_extend():
    case = Case(prefix_lens=[0, 9, 40], num_k=7, num_q=7, q_offset=0, page_size=4, seed=50)
    chain = torch.tril(torch.ones(7, 7, dtype=torch.bool)).expand(3, 7, 7).clone()
    for name in WINDOWED_BACKENDS:
        torch.testing.assert_close(case.run(name, chain, 4), case.run(name, None, 4),
                                   atol=1e-5, rtol=0)
