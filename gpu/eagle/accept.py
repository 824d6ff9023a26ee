"""Verify / accept: which draft-tree nodes the target model accepts, and the bonus token.

The target forward over a `DraftTree` gives, at every node j, the distribution (or argmax) of
the token that FOLLOWS node j. Both rules walk from the root:

- `accept_greedy`: move to the child whose token equals the target's argmax at the current
  node, while one exists; the bonus is the argmax at the last accepted node.
- `accept_sampling`: target-only recursive rejection sampling with deterministic (delta)
  proposals, as SGLang's ``tree_speculative_sampling_target_only``. At a node with target
  distribution p, its children are tried in column order; a child with token t is accepted
  with probability ``p[t] / sum(p)``, where p has the tokens of the siblings rejected before it
  zeroed (the residual). On acceptance the walk moves to the child (and its own distribution);
  when every child is rejected (or there is none) the bonus is drawn from the residual.

Exactness: at a node with children t_1..t_m, child t_k is emitted with probability
``prod_{i<k} (1 - p(t_i) / (1 - sum_{j<i} p(t_j))) * p(t_k) / (1 - sum_{j<k} p(t_j))``; the
product telescopes to ``1 - sum_{i<k} p(t_i)``, so t_k is emitted with probability p(t_k), and
any other token x with ``(1 - sum_i p(t_i)) * p(x) / (1 - sum_i p(t_i)) = p(x)``. Every emitted
token therefore follows the target distribution at its prefix, so by induction over the path
the emitted sequence follows the target model exactly, however poor the draft tree is.

Randomness is counter-based (`gpu.seeded_random.seeded_uniform`), so a request's outcome depends only
on its seed, positions, tree and target distributions, never on the batch:

- the accept coin of a child with token t, tried at a node whose follower takes position P, is
  ``seeded_uniform(seed, P, t, stream=1)``; along one walk every coin has a distinct (P, t)
  (siblings have distinct tokens; a deeper node has a larger P);
- the bonus at the final node (follower position P) is Gumbel-max over ``log(residual)`` with
  the sampler's own noise, stream 0: ``argmax(log r - log(-log u(seed, P, token, 0)))``. Stream
  0 noise is independent of the stream-1 coins that shaped the residual, so the draw is exact;
  and when no child was tried (the residual is the target distribution itself) it is the token
  `Sampler.sample` would draw at P, up to float rounding. The draft proposals must not use
  streams 0/1 at these positions (tree drafts come from a top-k, which draws nothing).

Tensors stay on the device; loops run over the tree depth (greedy) or its columns (sampling),
never over the batch, and there is no device sync when the tree carries ``max_depth``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gpu.eagle.tree import DraftTree, drafted_before
from gpu.kv_cache import KVPool
from gpu.seeded_random import gumbel_, seeded_uniform

ACCEPT_STREAM = 1  # seeded_uniform stream of the accept coins
BONUS_STREAM = 0  # and of the bonus draw's Gumbel noise (the sampler's own stream)


@dataclass
class AcceptResult:
    accept_lens: Tensor  # [bs] int64 accepted DRAFT tokens (0..max depth); the root never counts
    path: Tensor  # [bs, D+1] int64 tree columns: path[:, 0] = 0, then accepted nodes; -1 pad
    bonus_tokens: Tensor  # [bs] int64 drawn at the last accepted node (the next root)
    accepted_tokens: Tensor  # [bs, D+1] int64 accepted drafts then the bonus; -1 pad


def _finish(tree: DraftTree, path: Tensor, accept_lens: Tensor, bonus: Tensor) -> AcceptResult:
    """Emitted tokens: the tokens of path[:, 1:accept_lens+1], then the bonus, then -1."""
    bs, width = path.shape
    cols = torch.arange(width, device=path.device)
    drafted = tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # [bs, D]
    out = torch.cat([drafted, torch.zeros_like(drafted[:, :1])], dim=1)
    out = torch.where(cols < accept_lens[:, None], out, -1)
    out = torch.where(cols == accept_lens[:, None], bonus[:, None], out)
    return AcceptResult(accept_lens, path, bonus, out)


def _accept_probability(p_tok: Tensor, remaining: Tensor) -> Tensor:
    """A child's acceptance probability: its token's share of the residual mass (<= 1, as
    remaining >= p_tok; 0 when both are 0). A separate function so that the tests can break
    the rule on purpose and show their statistics notice."""
    return p_tok / remaining.clamp(min=torch.finfo(torch.float32).tiny)


def accept_greedy(tree: DraftTree, target_argmax: Tensor) -> AcceptResult:
    """Longest root path whose every node's token equals the target's argmax at its parent.
    target_argmax [bs, T]: the target's argmax at every node. Siblings hold distinct tokens, so
    at most one child can match (with duplicates the first column wins)."""
    bs, t = tree.tokens.shape
    dev = tree.tokens.device
    d = tree.depth_bound()
    target_argmax = target_argmax.long()
    if tree.chain:  # node j's parent is j - 1: the accepted drafts are the leading matches
        accept_lens = (tree.tokens[:, 1:] == target_argmax[:, :-1]).cumprod(1).sum(1)
        cols = torch.arange(t, device=dev)
        kept = cols <= accept_lens[:, None]
        # Each accepted draft equals the argmax at the node before it, and the bonus is the
        # argmax after the last: the emitted tokens are the argmaxes up to the bonus.
        return AcceptResult(accept_lens, torch.where(kept, cols, -1),
                            target_argmax.gather(1, accept_lens[:, None])[:, 0],
                            torch.where(kept, target_argmax, -1))
    cur = torch.zeros(bs, dtype=torch.long, device=dev)
    alive = torch.ones(bs, dtype=torch.bool, device=dev)
    accept_lens = torch.zeros(bs, dtype=torch.long, device=dev)
    path = torch.full((bs, d + 1), -1, dtype=torch.long, device=dev)
    path[:, 0].zero_()
    for step in range(1, d + 1):
        want = target_argmax.gather(1, cur[:, None])  # [bs, 1]
        match = (tree.parent == cur[:, None]) & (tree.tokens == want) & alive[:, None]
        alive = match.any(-1)
        nxt = match.int().argmax(-1)  # the first matching column
        cur = torch.where(alive, nxt, cur)
        path[:, step] = torch.where(alive, nxt, -1)
        accept_lens += alive
    bonus = target_argmax.gather(1, cur[:, None]).squeeze(1)
    return _finish(tree, path, accept_lens, bonus)


def accept_sampling(tree: DraftTree, target_probs: Tensor, seeds: Tensor,
                    positions: Tensor) -> AcceptResult:
    """Target-only rejection sampling over the tree (see the module docstring).

    target_probs [bs, T, V]: the target's distribution of the token following each node (the
    exact distribution the sampler draws from: `Sampler.target_probs`; a greedy row's one-hot
    makes this the greedy rule). seeds [bs]: the requests' seeds. positions [bs, T]: the
    sequence position the token following node j takes (the root's position + 1 + depth)."""
    bs, t = tree.tokens.shape
    dev = tree.tokens.device
    d = tree.depth_bound()
    v = target_probs.shape[-1]
    probs = target_probs.float()
    positions = positions.long()
    tokens = tree.tokens
    # A sibling repeating an earlier sibling's token is never accepted: its residual mass is 0
    # once the first copy is rejected (and it is unreachable once the first is accepted).
    earlier = torch.ones(t, t, dtype=torch.bool, device=dev).tril(-1)  # [j, k]: k < j
    dup = ((tree.parent[:, :, None] == tree.parent[:, None, :])
           & (tokens[:, :, None] == tokens[:, None, :]) & earlier).any(-1)
    total = probs.sum(-1)  # [bs, T] mass at each node
    rows = torch.arange(bs, device=dev)

    cur = torch.zeros(bs, dtype=torch.long, device=dev)  # the node the walk stands at
    removed = torch.zeros(bs, dtype=torch.float32, device=dev)  # mass rejected at cur
    accept_lens = torch.zeros(bs, dtype=torch.long, device=dev)
    path = torch.full((bs, d + 1), -1, dtype=torch.long, device=dev)
    path[:, 0].zero_()
    # Columns are in parent-before-child order and siblings in column order, so one pass over
    # the columns tries the current node's children in order and then, after an acceptance,
    # the accepted child's children (all in later columns).
    for j in range(1, t):
        tok = tokens[:, j]
        tried = tree.parent[:, j] == cur
        p_tok = probs[rows, cur, tok].masked_fill(dup[:, j], 0.0)
        remaining = torch.maximum(total[rows, cur] - removed, p_tok)
        u = seeded_uniform(seeds, positions[rows, cur], tok[:, None], stream=ACCEPT_STREAM)
        accept = tried & (u.squeeze(1) < _accept_probability(p_tok, remaining))
        reject = tried & ~accept
        removed = torch.where(accept, 0.0, removed + torch.where(reject, p_tok, 0.0))
        cur = torch.where(accept, j, cur)
        accept_lens += accept
        path[rows, accept_lens] = torch.where(accept, j, path[rows, accept_lens])

    # Bonus: every child of the final node was rejected; draw from the residual.
    residual = probs[rows, cur]  # [bs, V]
    children = (tree.parent == cur[:, None]).float()  # the root (parent -1) never is one
    rejected = torch.zeros_like(residual).scatter_add_(1, tokens, children) > 0
    residual = residual.masked_fill(rejected, 0.0)
    empty = ~(residual.sum(-1) > 0)  # only if float rounding ate the whole residual
    residual = torch.where(empty[:, None], probs[rows, cur], residual)
    vocab = torch.arange(v, device=dev)
    noise = gumbel_(seeded_uniform(seeds, positions[rows, cur], vocab, stream=BONUS_STREAM))
    bonus = (residual.log() + noise).argmax(-1)
    return _finish(tree, path, accept_lens, bonus)


def compact_accepted_kv(pool: KVPool, table: Tensor, slots: Tensor, seq_lens: Tensor,
                        result: AcceptResult) -> None:
    """Move the accepted nodes' target KV from index L + column to L + depth. Static
    shapes (no host sync): every depth is copied; one off the path, or already in place,
    copies its own KV onto itself (all reads happen before the writes)."""
    path = result.path[:, 1:]  # depth 1.. (the root is already at L)
    depth = torch.arange(1, path.shape[1] + 1, device=path.device).expand_as(path)
    src_col = torch.where(path >= 0, path, depth)
    rows = slots[:, None].expand_as(path)
    src = table[rows, seq_lens[:, None] + src_col].long().reshape(-1)
    dst = table[rows, seq_lens[:, None] + depth].long().reshape(-1)
    for layer in range(len(pool.k_buffer)):
        pool.k_buffer[layer][dst] = pool.k_buffer[layer][src]
        pool.v_buffer[layer][dst] = pool.v_buffer[layer][src]


def accept_verified(sampler, sampling_state, tree: DraftTree, logits: Tensor, slots: Tensor,
                    slots_host, positions: Tensor, flags) -> AcceptResult:
    """The accepted path of a verified tree, by the batch's sampling: greedy (with penalties
    and bans applied as plain decoding would) or by rejection sampling. `flags`: the batch's
    BatchFlags, every node's the same as its request's; `slots_host` may be None for a greedy
    batch (inside a CUDA graph)."""
    bs, T = tree.tokens.shape
    node_slots = slots.repeat_interleave(T)
    # A node samples the token after the drafts on its path: the penalties and the
    # min_new_tokens ban count them, as plain decoding would have by then.
    drafted = drafted_before(tree) if flags.any_penalty or flags.any_min_tokens else None
    if flags.all_greedy:
        processed = sampler.process_logits(logits, node_slots, flags, drafted)
        return accept_greedy(tree, processed.argmax(-1).view(bs, T))
    following = (positions + 1).reshape(-1)  # the position the next token takes
    probs = sampler.target_probs(logits, node_slots, following,
                                 slots_host=np.repeat(slots_host, T), drafted=drafted)
    seeds = sampling_state.seeds_of(slots)
    return accept_sampling(tree, probs.view(bs, T, -1), seeds, positions + 1)
