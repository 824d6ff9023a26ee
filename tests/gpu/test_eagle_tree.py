"""Draft-tree organisation: hand-computed trees, a naive per-row reference, chains, bs == 0."""

from __future__ import annotations

import pytest
import torch

from gpu.eagle.tree import DraftTree, chain_tree, organize_draft_tree

t = torch.tensor



@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """These tensors are small: one thread avoids OpenMP barrier stalls."""


def ancestors_mask(parent: list[int]) -> list[list[bool]]:
    n = len(parent)
    mask = [[False] * n for _ in range(n)]
    for j in range(n):
        k = j
        while k >= 0:
            mask[j][k] = True
            k = parent[k]
    return mask


def check_consistent(tree: DraftTree) -> None:
    """Shapes, parent-before-child order, depth and mask agree with parent."""
    bs, n = tree.tokens.shape
    assert tree.parent.shape == tree.depth.shape == (bs, n)
    assert tree.mask.shape == (bs, n, n) and tree.mask.dtype == torch.bool
    for b in range(bs):
        parent = tree.parent[b].tolist()
        assert parent[0] == -1 and all(0 <= p < j for j, p in enumerate(parent) if j)
        assert tree.mask[b].tolist() == ancestors_mask(parent)
        depth = [0] * n
        for j in range(1, n):
            depth[j] = depth[parent[j]] + 1
        assert tree.depth[b].tolist() == depth
        assert tree.max_depth is None or max(depth) <= tree.max_depth


# The worked example (topk = 2, num_steps = 3). Candidates by global index:
#   step 0: g0 .6 (10), g1 .35 (11)                          parents_0 = [-1, 0, 1]
#   step 1: under g0: g2 .30 (20), g3 .18 (21); under g1: g4 .28 (22), g5 .035 (23)
#           expanded: parents_1 = [2, 4]
#   step 2: under g2: g6 .21 (30), g7 .06 (31); under g4: g8 .14 (32), g9 .112 (33)
# The best 7: g0 g1 g2 g4 g6 g3 g8 -> columns 1..7 = g0 g1 g2 g3 g4 g6 g8.
EXAMPLE = (
    [t([[[0.6, 0.35]]]), t([[[0.30, 0.18], [0.28, 0.035]]]), t([[[0.21, 0.06], [0.14, 0.112]]])],
    [t([[10, 11]]), t([[20, 21, 22, 23]]), t([[30, 31, 32, 33]])],
    [t([[-1, 0, 1]]), t([[2, 4]]), t([[6, 8]])],
)


def test_worked_example_topk2_three_steps():
    scores, tokens, parents = EXAMPLE
    tree = organize_draft_tree(scores, tokens, parents, t([5]), num_draft_tokens=8)
    assert tree.tokens.tolist() == [[5, 10, 11, 20, 21, 22, 30, 32]]
    assert tree.parent.tolist() == [[-1, 0, 0, 1, 1, 2, 3, 5]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 2, 3, 3]]
    assert tree.selected.tolist() == [[0, 1, 2, 3, 4, 6, 8]]
    assert tree.mask.int().tolist() == [[
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],
        [1, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1, 0, 1],
    ]]
    assert tree.tokens.dtype == tree.parent.dtype == tree.depth.dtype == torch.int64
    # The last step's parents are optional (unused).
    again = organize_draft_tree(scores, tokens, parents[:2], t([5]), num_draft_tokens=8)
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.mask, tree.mask)
    # Fewer drafts: the best 3 are g0 g1 g2.
    small = organize_draft_tree(scores, tokens, parents, t([5]), num_draft_tokens=4)
    assert small.tokens.tolist() == [[5, 10, 11, 20]]
    assert small.parent.tolist() == [[-1, 0, 0, 1]]
    # Root only.
    root = organize_draft_tree(scores, tokens, parents, t([5]), num_draft_tokens=1)
    assert root.tokens.tolist() == [[5]] and root.mask.tolist() == [[[True]]]
    with pytest.raises(ValueError):
        organize_draft_tree(scores, tokens, parents, t([5]), num_draft_tokens=12)


def test_dropped_parent_attaches_to_nearest_kept_ancestor():
    # Scores that are not monotone along a path (as topk ties could make them): g4 (.5) is
    # kept while its parent g1 (.05) is not, and g8 (.3) is kept while its parent g2 (.02) is
    # not but its grandparent g0 is.
    scores = [t([[[0.9, 0.05]]]), t([[[0.02, 0.01], [0.5, 0.001]]]),
              t([[[0.4, 0.003], [0.3, 0.002]]])]
    tokens = [t([[10, 11]]), t([[20, 21, 22, 23]]), t([[30, 31, 32, 33]])]
    parents = [t([[-1, 0, 1]]), t([[4, 2]]), t([[6, 8]])]
    tree = organize_draft_tree(scores, tokens, parents, t([1]), num_draft_tokens=5)
    assert tree.selected.tolist() == [[0, 4, 6, 8]]
    assert tree.tokens.tolist() == [[1, 10, 22, 30, 32]]
    assert tree.parent.tolist() == [[-1, 0, 0, 2, 1]]  # g4 -> root, g6 -> g4, g8 -> g0
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2]]
    check_consistent(tree)


def chain_steps(bs: int, n: int, gen: torch.Generator):
    """A topk == 1 draft loop's outputs: one candidate per step."""
    probs = torch.rand(bs, n, generator=gen) * 0.5 + 0.5
    cum = probs.cumprod(1)
    toks = torch.randint(0, 1000, (bs, n), generator=gen)
    scores = [cum[:, i].reshape(bs, 1, 1) for i in range(n)]
    tokens = [toks[:, i:i + 1] for i in range(n)]
    parents = [t([-1, 0]).expand(bs, 2)] + [torch.full((bs, 1), i) for i in range(1, n)]
    return scores, tokens, parents, toks


def test_topk1_is_a_chain():
    gen = torch.Generator().manual_seed(0)
    scores, tokens, parents, toks = chain_steps(3, 4, gen)
    root = t([7, 8, 9])
    tree = organize_draft_tree(scores, tokens, parents, root, num_draft_tokens=5)
    chain = chain_tree(root, toks)
    assert tree.tokens.tolist() == torch.cat([root[:, None], toks], 1).tolist()
    assert tree.parent.tolist() == [[-1, 0, 1, 2, 3]] * 3
    assert tree.depth.tolist() == [[0, 1, 2, 3, 4]] * 3
    assert torch.equal(tree.mask, torch.ones(5, 5, dtype=torch.bool).tril().expand(3, 5, 5))
    for field in ("tokens", "parent", "depth", "mask"):
        assert torch.equal(getattr(tree, field), getattr(chain, field)), field
    check_consistent(chain)
    # A shorter chain keeps the first drafts (cumulative scores only fall).
    short = organize_draft_tree(scores, tokens, parents, root, num_draft_tokens=3)
    assert short.tokens.tolist() == torch.cat([root[:, None], toks[:, :2]], 1).tolist()


def test_empty_batch():
    scores, tokens, parents = EXAMPLE
    empty = organize_draft_tree([s[:0] for s in scores], [x[:0] for x in tokens],
                                [p[:0] for p in parents], t([], dtype=torch.long), 8)
    assert empty.tokens.shape == empty.parent.shape == empty.depth.shape == (0, 8)
    assert empty.mask.shape == (0, 8, 8) and empty.mask.dtype == torch.bool
    assert empty.tokens.dtype == torch.int64
    chain = chain_tree(t([], dtype=torch.long), torch.zeros(0, 3, dtype=torch.long))
    assert chain.tokens.shape == (0, 4) and chain.mask.shape == (0, 4, 4)


# ---------------------------------------------------------------------------------------------
# Random draft loops against a naive per-row reference.


def random_draft_loop(bs: int, topk: int, num_steps: int, gen: torch.Generator):
    """Outputs shaped like SGLang's select_top_k_tokens, with consistent cumulative scores."""
    scores, tokens, parents = [], [], []
    p0 = torch.rand(bs, topk, generator=gen).softmax(-1)
    scores.append(p0[:, None, :])
    tokens.append(torch.randint(0, 500, (bs, topk), generator=gen))
    parents.append(torch.arange(-1, topk).expand(bs, topk + 1))
    node_scores = p0  # [bs, topk] scores of the nodes expanded next
    node_index = torch.arange(topk).expand(bs, topk)  # and their global indices
    for i in range(1, num_steps):
        # Child probabilities (summing to < 1, as a draft's top-k does): no score ties.
        child = torch.rand(bs, topk, topk, generator=gen).softmax(-1)
        child = child * (0.5 + 0.5 * torch.rand(bs, topk, 1, generator=gen))
        s = node_scores[:, :, None] * child
        scores.append(s)
        tokens.append(torch.randint(0, 500, (bs, topk * topk), generator=gen))
        parents.append(node_index)
        top = s.flatten(1).topk(topk, dim=1)
        node_scores = top.values
        node_index = top.indices + topk * topk * (i - 1) + topk
    return scores, tokens, parents


def naive_organize(scores, tokens, parents, root, n_draft, topk):
    flat_s = torch.cat([s.flatten() for s in scores]).tolist()
    flat_t = torch.cat([x.flatten() for x in tokens]).tolist()
    plist = torch.cat([p.flatten() for p in parents[:-1]]).tolist() if len(parents) > 1 else []
    order = sorted(range(len(flat_s)), key=lambda g: -flat_s[g])
    kept = sorted(order[:n_draft - 1])
    col = {g: j + 1 for j, g in enumerate(kept)}

    def parent_of(g):
        return -1 if g // topk == 0 else plist[g // topk]

    out_parent = [-1]
    for g in kept:
        a = parent_of(g)
        while a >= 0 and a not in col:
            a = parent_of(a)
        out_parent.append(0 if a < 0 else col[a])
    return [root] + [flat_t[g] for g in kept], out_parent


@pytest.mark.parametrize("topk,num_steps,n_draft", [(2, 3, 8), (4, 5, 16), (3, 1, 3),
                                                    (1, 6, 5), (4, 3, 2)])
def test_random_loops_match_naive_reference(topk, num_steps, n_draft):
    gen = torch.Generator().manual_seed(topk * 100 + num_steps)
    bs = 6
    scores, tokens, parents = random_draft_loop(bs, topk, num_steps, gen)
    root = torch.randint(0, 500, (bs,), generator=gen)
    tree = organize_draft_tree(scores, tokens, parents, root, n_draft)
    check_consistent(tree)
    for b in range(bs):
        want_tokens, want_parent = naive_organize(
            [s[b] for s in scores], [x[b] for x in tokens], [p[b] for p in parents],
            int(root[b]), n_draft, topk)
        assert tree.tokens[b].tolist() == want_tokens
        assert tree.parent[b].tolist() == want_parent
    # Batch-independent: a row alone gives the same tree.
    alone = organize_draft_tree([s[2:3] for s in scores], [x[2:3] for x in tokens],
                                [p[2:3] for p in parents], root[2:3], n_draft)
    assert torch.equal(alone.tokens[0], tree.tokens[2])
    assert torch.equal(alone.mask[0], tree.mask[2])
