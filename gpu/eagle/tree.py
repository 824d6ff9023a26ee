"""Draft trees: the best `num_draft_tokens` nodes of an EAGLE draft loop, organised for verify.

The draft loop runs `num_steps` steps with `topk` children per node and produces, per step, the
outputs of SGLang's ``select_top_k_tokens``:

- step 0: ``scores_0`` [bs, 1, topk] (probabilities of the root's children), ``tokens_0``
  [bs, topk], ``parents_0`` [bs, topk + 1] = [-1, 0, 1, ..., topk - 1];
- step i >= 1: ``scores_i`` [bs, topk, topk] (cumulative score of expanded node r times the
  probability of its child c), ``tokens_i`` [bs, topk * topk] (row-major r, c), ``parents_i``
  [bs, topk]: the global candidate index of the topk step-i nodes chosen for expansion.

Global candidate numbering concatenates the flattened scores over the steps: step 0 holds
candidates 0..topk-1 and step i >= 1 holds ``topk + (i-1)*topk**2 + r*topk + c``. The parent of
candidate g is ``parent_list[g // topk]`` with ``parent_list = cat(parents_0 .. parents_{S-2})``
(-1 = the root), as in SGLang's ``organize_draft_results`` / ``build_tree_kernel_efficient``.

`organize_draft_tree` keeps the ``num_draft_tokens - 1`` best candidates by cumulative score
and sorts them by global index, so a node's parent always sits in an earlier column (a parent
is drafted in an earlier step, and its cumulative score is >= its children's). Column 0 is the
root (the last verified token). Everything is vectorised over the batch; the only Python loops
run over the number of steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpu.sampling_state import DraftedBefore


@dataclass
class DraftTree:
    """A draft tree per request; every row has the same number of nodes T. Columns are in
    parent-before-child order (parent[b, j] < j) and siblings in column order; the acceptance
    rules rely on it."""

    tokens: Tensor  # [bs, T] int64: column 0 = the root token, columns 1.. = the drafts
    parent: Tensor  # [bs, T] int64: column of each node's parent; the root's is -1
    depth: Tensor  # [bs, T] int64: the root is 0
    mask: Tensor  # [bs, T, T] bool: mask[b, j, k] = k is j or an ancestor of j
    # A host-side upper bound on depth.max() (no device sync to size the accept loop); None:
    # the consumers compute depth.max().
    max_depth: int | None = None
    # [bs, T - 1] int64 global candidate index of columns 1.. (ascending), when organised from
    # a draft loop; None for a chain.
    selected: Tensor | None = None
    chain: bool = False  # node j's parent is j - 1 (`chain_tree`): acceptance takes a shortcut

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def depth_bound(self) -> int:
        if self.max_depth is not None:
            return self.max_depth
        return int(self.depth.max()) if self.depth.numel() else 0


def _ancestor_mask(parent: Tensor, max_depth: int) -> Tensor:
    """mask[b, j, k] = k is j or an ancestor of j, by walking every column up `max_depth`
    times at once (parents point to earlier columns; -1 ends a walk)."""
    bs, t = parent.shape
    cur = torch.arange(t, device=parent.device).expand(bs, t).clone()
    mask = torch.zeros(bs, t, t, dtype=torch.bool, device=parent.device)
    cols = torch.arange(t, device=parent.device)
    for _ in range(max_depth + 1):
        mask |= (cur[:, :, None] == cols) & (cur[:, :, None] >= 0)
        cur = torch.where(cur >= 0, parent.gather(1, cur.clamp(min=0)), cur)
    return mask


def organize_draft_tree(scores: list[Tensor], tokens: list[Tensor], parents: list[Tensor],
                        root_tokens: Tensor, num_draft_tokens: int) -> DraftTree:
    """Keep the ``num_draft_tokens - 1`` candidates with the best cumulative scores
    (``torch.topk`` over the flattened scores of every step), sorted by global candidate index,
    under the root token ``root_tokens`` [bs].

    `parents` may hold all ``num_steps`` entries (the draft loop's full list; the last is
    unused) or just the first ``num_steps - 1``.

    Dropped parents: a child's cumulative score never exceeds its parent's, so the top-k keeps
    a node's parent unless the two tie at the cut (a child probability that rounds to 1, or
    scores that underflow to 0) and topk's tie-breaking keeps the child alone. Such a node is
    attached to its nearest kept ancestor, or to the root, and its depth (hence its position)
    is its depth in the resulting tree. Verification stays exact either way: the target checks
    whatever tokens the tree holds along each root path.
    """
    num_steps = len(scores)
    if num_steps == 0:
        raise ValueError("organize_draft_tree needs at least one draft step")
    topk = tokens[0].shape[1]
    bs = root_tokens.shape[0]
    dev = root_tokens.device
    flat_scores = torch.cat([s.flatten(1) for s in scores], dim=1)  # [bs, N]
    flat_tokens = torch.cat([t.flatten(1) for t in tokens], dim=1).long()
    n_cand = flat_scores.shape[1]
    n_keep = num_draft_tokens - 1
    if not 0 <= n_keep <= n_cand:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} must be in [1, {n_cand + 1}] "
                         f"for num_steps={num_steps}, topk={topk}")

    # Global parent index of every candidate (-1 = root).
    block = torch.arange(n_cand, device=dev) // topk
    if num_steps > 1:
        parent_list = torch.cat([p.long() for p in parents[:num_steps - 1]], dim=1)
        cand_parent = parent_list[:, block]
        cand_parent = cand_parent.masked_fill(block == 0, -1)  # step 0's parents are the root
    else:
        cand_parent = torch.full((bs, n_cand), -1, dtype=torch.long, device=dev)

    sel = flat_scores.topk(n_keep, dim=1).indices.sort(dim=1).values  # [bs, T-1]
    draft = flat_tokens.gather(1, sel)

    # Column of each kept node's nearest kept ancestor (0 = the root). A node's ancestors
    # come from earlier steps, so at most num_steps - 1 hops reach the root.
    parent_col = torch.zeros_like(sel)
    found = torch.zeros(sel.shape, dtype=torch.bool, device=dev)
    anc = cand_parent.gather(1, sel)
    for _ in range(num_steps):
        if n_keep == 0:
            break
        pos = torch.searchsorted(sel, anc.clamp(min=0)).clamp(max=n_keep - 1)
        hit = ~found & (anc >= 0) & (sel.gather(1, pos) == anc)
        parent_col = torch.where(hit, pos + 1, parent_col)
        found |= hit | (anc < 0)
        anc = torch.where(anc >= 0, cand_parent.gather(1, anc.clamp(min=0)), anc)

    root_parent = torch.full((bs, 1), -1, dtype=torch.long, device=dev)
    parent = torch.cat([root_parent, parent_col], dim=1)
    max_depth = min(num_steps, n_keep)
    mask = _ancestor_mask(parent, max_depth)
    depth = mask.sum(-1) - 1
    tree_tokens = torch.cat([root_tokens.long()[:, None], draft], dim=1)
    return DraftTree(tree_tokens, parent, depth, mask, max_depth=max_depth, selected=sel)


def chain_tree(root_tokens: Tensor, draft_tokens: Tensor) -> DraftTree:
    """A chain (topk 1, every draft kept): the root, then `draft_tokens` [bs, n] in order. What
    organize_draft_tree gives for it, without the top-k and the ancestor walk (~0.4 ms of a
    ~11 ms one-stream step on 2 cores)."""
    bs, n = draft_tokens.shape
    cols = torch.arange(n + 1, device=root_tokens.device)
    tokens = torch.cat([root_tokens.long()[:, None], draft_tokens.long()], dim=1)
    mask = (cols[None, :] <= cols[:, None]).expand(bs, -1, -1)
    return DraftTree(tokens, (cols - 1).expand(bs, -1), cols.expand(bs, -1), mask,
                     max_depth=n, chain=True)


def drafted_before(tree: DraftTree) -> DraftedBefore:
    """Per tree node (row b * T + j), the drafts on its path from the root, itself included:
    the outputs that come before the token node j's logits sample. The root's own token was
    counted when it was emitted (it is the previous step's bonus)."""
    bs, t = tree.tokens.shape
    tokens = tree.tokens[:, None, 1:].expand(bs, t, t - 1).reshape(bs * t, t - 1)
    return DraftedBefore(tokens.clamp(min=0), tree.mask[:, :, 1:].reshape(bs * t, t - 1))
