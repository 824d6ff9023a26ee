"""Verify / accept: greedy on hand-made trees, and the sampling rule's output distribution
(chi-square against the target at each node, with a deliberately broken rule to show the test
has power). Also `Sampler.target_probs` against `Sampler.sample`'s empirical frequencies."""

from __future__ import annotations

import pytest
import torch

import gpu.eagle.accept as accept_mod
from gpu import cpu_sampling
from gpu.eagle.accept import AcceptResult, accept_greedy, accept_sampling
from gpu.eagle.tree import DraftTree, _ancestor_mask, chain_tree, organize_draft_tree
from gpu.sampler import Sampler
from gpu.sampling_state import SamplingState
from ipc.sampling import SamplingParams

t = torch.tensor
P_CRIT = 1e-3  # chi-square tests reject below this p-value



@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """These tensors are small: one thread avoids OpenMP barrier stalls."""


def make_tree(tokens: list[list[int]], parent: list[int]) -> DraftTree:
    """Rows share one structure; max_depth left for the consumers to compute."""
    tok = t(tokens)
    par = t(parent).expand(tok.shape[0], -1).clone()
    mask = _ancestor_mask(par, len(parent))
    return DraftTree(tok, par, mask.sum(-1) - 1, mask)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs over the categories with probs > 0; the
    survival function of chi2(df) is the regularised upper incomplete gamma Q(df/2, x/2).
    NaN (which fails every `> P_CRIT`) when there are no counts at all."""
    counts, probs = counts.double(), probs.double()
    if counts.sum() == 0:
        return float("nan")
    support = probs > 0
    assert counts[~support].sum() == 0, "a zero-probability token was emitted"
    counts, probs = counts[support], probs[support] / probs[support].sum()
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = support.sum() - 1
    return float(torch.special.gammaincc(df / 2.0, stat / 2.0))


# ---------------------------------------------------------------------------------------------
# Greedy.

# root 0 (token 5): children 1 (7), 2 (8); 1: children 3 (9), 4 (10); 2: child 5 (11);
# 3: child 6 (12).
PARENT = [-1, 0, 0, 1, 1, 2, 3]
TOKENS = [5, 7, 8, 9, 10, 11, 12]


def test_greedy_hand_made_tree():
    tree = make_tree([TOKENS] * 4, PARENT)
    argmax = t([
        [7, 9, 0, 12, 0, 0, 42],  # full accept: 1 -> 3 -> 6, bonus 42
        [7, 10, 0, 0, 50, 0, 0],  # partial, through the 2nd sibling: 1 -> 4, bonus 50
        [3, 9, 11, 12, 0, 0, 0],  # the root's argmax matches no child
        [8, 9, 11, 0, 0, 60, 0],  # the 2nd sibling at the root: 2 -> 5, bonus 60
    ])
    res = accept_greedy(tree, argmax)
    assert res.accept_lens.tolist() == [3, 2, 0, 2]
    assert res.path.tolist() == [[0, 1, 3, 6], [0, 1, 4, -1], [0, -1, -1, -1], [0, 2, 5, -1]]
    assert res.bonus_tokens.tolist() == [42, 50, 3, 60]
    assert res.accepted_tokens.tolist() == [[7, 9, 12, 42], [7, 10, 50, -1],
                                            [3, -1, -1, -1], [8, 11, 60, -1]]
    for field in ("accept_lens", "path", "bonus_tokens", "accepted_tokens"):
        assert getattr(res, field).dtype == torch.int64


def test_greedy_chain():
    tree = chain_tree(t([1, 1, 1]), t([[4, 5, 6]] * 3))
    argmax = t([[4, 5, 6, 9], [4, 8, 6, 9], [2, 5, 6, 9]])
    res = accept_greedy(tree, argmax)
    assert res.accept_lens.tolist() == [3, 1, 0]
    assert res.bonus_tokens.tolist() == [9, 8, 2]
    assert res.accepted_tokens.tolist() == [[4, 5, 6, 9], [4, 8, -1, -1], [2, -1, -1, -1]]
    assert res.path.tolist() == [[0, 1, 2, 3], [0, 1, -1, -1], [0, -1, -1, -1]]


def test_empty_batch():
    tree = make_tree([TOKENS], PARENT)
    empty = DraftTree(tree.tokens[:0], tree.parent[:0], tree.depth[:0], tree.mask[:0],
                      max_depth=3)
    for res in (accept_greedy(empty, torch.zeros(0, 7, dtype=torch.long)),
                accept_sampling(empty, torch.zeros(0, 7, 10), torch.zeros(0, dtype=torch.long),
                                torch.zeros(0, 7, dtype=torch.long))):
        assert isinstance(res, AcceptResult)
        assert res.accept_lens.shape == res.bonus_tokens.shape == (0,)
        assert res.path.shape == res.accepted_tokens.shape == (0, 4)


def random_tree(bs: int, gen: torch.Generator, topk=3, num_steps=4, n_draft=10, vocab=50):
    scores, tokens, parents = [], [], []
    node_scores = torch.rand(bs, topk, generator=gen).softmax(-1)
    scores.append(node_scores[:, None])
    # Distinct sibling tokens: a random permutation slice per node.
    perm = lambda n: torch.rand(bs, n, vocab, generator=gen).argsort(-1)[..., :topk]  # noqa
    tokens.append(perm(1).reshape(bs, topk))
    parents.append(torch.arange(-1, topk).expand(bs, topk + 1))
    node_index = torch.arange(topk).expand(bs, topk)
    for i in range(1, num_steps):
        s = node_scores[:, :, None] * torch.rand(bs, topk, topk, generator=gen).softmax(-1)
        scores.append(s)
        tokens.append(perm(topk).reshape(bs, topk * topk))
        parents.append(node_index)
        top = s.flatten(1).topk(topk, dim=1)
        node_scores, node_index = top.values, top.indices + topk * topk * (i - 1) + topk
    root = torch.randint(0, vocab, (bs,), generator=gen)
    return organize_draft_tree(scores, tokens, parents, root, n_draft)


def test_sampling_with_one_hot_targets_is_greedy():
    """A greedy row's target_probs is a one-hot: the sampling rule must reduce to greedy."""
    gen = torch.Generator().manual_seed(3)
    bs, vocab = 64, 50
    tree = random_tree(bs, gen, vocab=vocab)
    n = tree.num_nodes
    # The target agrees with a random child of each node 70% of the time.
    child_tok = torch.where(tree.parent[:, None, :] == torch.arange(n)[None, :, None],
                            tree.tokens[:, None, :], -1)  # [bs, T(node), T(col)]
    pick = torch.rand(bs, n, n, generator=gen).masked_fill(child_tok < 0, -1).argmax(-1)
    argmax = child_tok.gather(2, pick[..., None]).squeeze(2)
    miss = (argmax < 0) | (torch.rand(bs, n, generator=gen) > 0.7)
    argmax = torch.where(miss, torch.randint(0, vocab, (bs, n), generator=gen), argmax)
    want = accept_greedy(tree, argmax)
    assert 0 < want.accept_lens.float().mean() < tree.max_depth  # a mix of outcomes
    one_hot = torch.nn.functional.one_hot(argmax, vocab).float()
    got = accept_sampling(tree, one_hot, torch.arange(bs), torch.arange(n).expand(bs, n))
    for field in ("accept_lens", "path", "bonus_tokens", "accepted_tokens"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_a_chain_is_organised_and_accepted_as_the_general_tree_is():
    """chain_tree and accept_greedy's chain shortcut give what organize_draft_tree and the
    general walk give for the same chain (topk 1, every draft kept), match by match."""
    gen = torch.Generator().manual_seed(5)
    bs, steps, vocab = 256, 4, 6  # a small vocabulary: every accept length occurs
    root = torch.randint(0, vocab, (bs,), generator=gen)
    drafts = [torch.randint(0, vocab, (bs, 1), generator=gen) for _ in range(steps)]
    scores = [torch.rand(bs, 1, 1, generator=gen).cumprod(0)] + [
        torch.rand(bs, 1, 1, generator=gen) * 0.5 for _ in range(steps - 1)]
    parents = [torch.arange(-1, 1).expand(bs, 2)] + [
        torch.full((bs, 1), i + 1, dtype=torch.long) for i in range(steps - 1)]
    general = organize_draft_tree(scores, drafts, parents, root, steps + 1)
    chain = chain_tree(root, torch.cat(drafts, dim=1))
    for field in ("tokens", "parent", "depth", "mask"):
        assert torch.equal(getattr(chain, field), getattr(general, field)), field
    assert chain.max_depth == general.max_depth == steps and chain.chain and not general.chain
    # The target agrees with each next draft 60% of the time.
    agree = torch.rand(bs, steps + 1, generator=gen) < 0.6
    nxt = torch.cat([chain.tokens[:, 1:], root[:, None]], 1)
    argmax = torch.where(agree, nxt, torch.randint(0, vocab, (bs, steps + 1), generator=gen))
    want, got = accept_greedy(general, argmax), accept_greedy(chain, argmax)
    assert set(got.accept_lens.tolist()) == set(range(steps + 1))
    for field in ("accept_lens", "path", "bonus_tokens", "accepted_tokens"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


# ---------------------------------------------------------------------------------------------
# Sampling: the emitted tokens follow the target distribution.

V = 6
# Distinct target distributions at the 7 nodes of PARENT (one has a zero).
NODE_PROBS = t([
    [0.10, 0.12, 0.15, 0.18, 0.20, 0.25],
    [0.30, 0.00, 0.30, 0.10, 0.20, 0.10],
    [0.20, 0.22, 0.10, 0.30, 0.13, 0.05],
    [0.05, 0.35, 0.10, 0.10, 0.15, 0.25],
    [0.40, 0.10, 0.10, 0.10, 0.20, 0.10],
    [0.15, 0.15, 0.15, 0.15, 0.30, 0.10],
    [0.10, 0.10, 0.50, 0.10, 0.10, 0.10],
])


def draft_tokens(kind: str) -> list[int]:
    """Draft tokens for PARENT's structure: each node's children take its least likely tokens
    ("poor": mostly rejected, and one draft has probability 0) or its most likely ones."""
    order = NODE_PROBS.sort(dim=-1, descending=kind == "good", stable=True).indices.tolist()
    tokens, used = [0] * len(PARENT), [0] * len(PARENT)
    for j in range(1, len(PARENT)):
        p = PARENT[j]
        tokens[j] = order[p][used[p]]
        used[p] += 1
    return tokens


def emitted_pvalues(kind: str, bs: int = 20000) -> tuple[dict[str, float], AcceptResult]:
    """Accept over bs seeds at once; p-values for (a) the first emitted token against the
    root's distribution and (b) the second given the first, for each root child, against
    that child's distribution."""
    tokens = draft_tokens(kind)
    tree = make_tree([tokens] * bs, PARENT)
    probs = NODE_PROBS.expand(bs, -1, -1)
    positions = (100 + tree.depth).expand(bs, -1)
    res = accept_sampling(tree, probs, torch.arange(bs) * 7919 + 11, positions)
    first, second = res.accepted_tokens[:, 0], res.accepted_tokens[:, 1]
    pvalues = {"root": chi_square_pvalue(torch.bincount(first, minlength=V), NODE_PROBS[0])}
    for col in (1, 2):  # the root's children
        given = first == tokens[col]
        assert (second[given] >= 0).all()  # the child was accepted, so a 2nd token follows
        counts = torch.bincount(second[given], minlength=V)
        pvalues[f"after col {col}"] = chi_square_pvalue(counts, NODE_PROBS[col])
    return pvalues, res


@pytest.mark.parametrize("kind", ["poor", "good"])
def test_sampling_follows_target_distribution(kind):
    pvalues, res = emitted_pvalues(kind)
    assert all(p > P_CRIT for p in pvalues.values()), pvalues
    first = res.accepted_tokens[:, 0]
    tokens = draft_tokens(kind)
    assert min((first == tokens[1]).sum(), (first == tokens[2]).sum()) > 1500  # enough data
    lens = res.accept_lens
    assert ((lens >= 0) & (lens <= 3)).all()
    # Every accepted draft lies on a root path and the emitted tokens are its tokens.
    tokens = torch.tensor(tokens)
    for b in range(0, 20000, 997):
        n = int(lens[b])
        path = res.path[b, :n + 1].tolist()
        assert path[0] == 0 and all(PARENT[path[i + 1]] == path[i] for i in range(n))
        assert res.accepted_tokens[b, :n].tolist() == tokens[path[1:]].tolist()
        assert res.accepted_tokens[b, n] == res.bonus_tokens[b]
        assert (res.accepted_tokens[b, n + 1:] == -1).all() and (res.path[b, n + 1:] == -1).all()
    if kind == "good":
        assert lens.float().mean() > 0.4  # drafts do get accepted


@pytest.mark.parametrize("kind", ["poor", "good"])
@pytest.mark.parametrize("wrong", ["no renormalisation", "always accept"])
def test_broken_rule_is_detected(monkeypatch, kind, wrong):
    """The same statistics reject a deliberately wrong acceptance rule: the test has power."""
    if wrong == "no renormalisation":  # accept with p[t], ignoring the rejected siblings' mass
        rule = lambda p_tok, remaining: p_tok  # noqa: E731
    else:
        rule = lambda p_tok, remaining: torch.where(p_tok > 0, 1.0, 0.0)  # noqa: E731
    monkeypatch.setattr(accept_mod, "_accept_probability", rule)
    pvalues, _ = emitted_pvalues(kind)
    assert not all(p > P_CRIT for p in pvalues.values()), pvalues


def test_sampling_is_reproducible_and_batch_independent():
    gen = torch.Generator().manual_seed(11)
    bs, vocab = 40, 50
    tree = random_tree(bs, gen, vocab=vocab)
    n = tree.num_nodes
    probs = (torch.randn(bs, n, vocab, generator=gen) * 2).softmax(-1)
    seeds = torch.randint(0, 2**62, (bs,), generator=gen)
    positions = (torch.randint(0, 1000, (bs, 1), generator=gen) + tree.depth)
    res = accept_sampling(tree, probs, seeds, positions)
    again = accept_sampling(tree, probs, seeds, positions)
    assert torch.equal(res.accepted_tokens, again.accepted_tokens)
    perm = torch.randperm(bs, generator=gen)[:7]
    sub = DraftTree(tree.tokens[perm], tree.parent[perm], tree.depth[perm], tree.mask[perm],
                    max_depth=tree.max_depth)
    part = accept_sampling(sub, probs[perm], seeds[perm], positions[perm])
    assert torch.equal(part.accepted_tokens, res.accepted_tokens[perm])
    assert torch.equal(part.path, res.path[perm])
    other = accept_sampling(tree, probs, seeds + 1, positions)
    assert not torch.equal(other.accepted_tokens, res.accepted_tokens)


# ---------------------------------------------------------------------------------------------
# Sampler.target_probs: the distribution Sampler.sample draws from.

VOCAB = 12
EOS = 11
CONFIGS = {
    1: SamplingParams(temperature=0.8, top_k=4, seed=1),
    2: SamplingParams(top_p=0.7, seed=2),
    3: SamplingParams(temperature=1.3, min_p=0.2, seed=3),
    4: SamplingParams(top_k=6, top_p=0.8, min_p=0.05, seed=4),
    5: SamplingParams(seed=5),
    6: SamplingParams(temperature=0.0),
    7: SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, min_new_tokens=3, seed=7),
    8: SamplingParams(top_k=2, seed=8),  # its logits tie three ways at the cut
}


def sampler_setup():
    state = SamplingState(10, VOCAB, "cpu", eos_token_ids=[EOS])
    for slot, params in CONFIGS.items():
        state.set_request(slot, params, prompt_ids=[0, 1, 2] if slot == 7 else [])
    state.record_outputs(t([7, 7]), t([3, 3]))
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(len(CONFIGS) + 1, VOCAB, generator=gen) * 1.5
    logits[7, EOS] = 4.0  # eos would be likely, but min_new_tokens bans it
    logits[8] = t([0.5, 3.0, -1.0, 3.0, 0.2, 3.0, 1.0, -2.0, 0.0, 2.0, -0.5, 0.1])
    return state, Sampler(state), logits


@pytest.mark.parametrize("slots", [[1], [2], [3], [4], [5], [6], [7], [8], list(CONFIGS)])
def test_target_probs_match_sampler_frequencies(slots):
    state, sampler, logits = sampler_setup()
    batch = t(slots)
    probs = sampler.target_probs(logits[batch], batch, torch.zeros(len(slots)))
    assert probs.shape == (len(slots), VOCAB) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(slots)))
    n = 20000
    # n draws per slot: the batch repeated, each copy at its own position.
    reps = batch.repeat(n)
    positions = torch.arange(n).repeat_interleave(len(slots))
    drawn = sampler.sample(logits[batch].repeat(n, 1), reps, positions).token_ids.view(n, -1)
    for i, slot in enumerate(slots):
        counts = torch.bincount(drawn[:, i], minlength=VOCAB)
        if CONFIGS[slot].greedy:
            assert probs[i].tolist() == torch.nn.functional.one_hot(
                logits[slot].argmax(), VOCAB).float().tolist()
            assert (drawn[:, i] == logits[slot].argmax()).all()
            continue
        assert chi_square_pvalue(counts, probs[i]) > P_CRIT, (slot, counts, probs[i])
        assert ((probs[i] > 0) == (counts > 0)).all()  # truncated <=> never drawn
    # Rows not computed alone still agree with those computed alone (within their batch path).
    for i, slot in enumerate(slots):
        alone = sampler.target_probs(logits[slot:slot + 1], t([slot]), t([0]))
        if slot != 8:  # the tie at slot 8's cut may resolve by the batch's candidate list
            torch.testing.assert_close(alone[0], probs[i])


def test_target_probs_truncation_details():
    state, sampler, logits = sampler_setup()
    probs = sampler.target_probs(logits[1:9], torch.arange(1, 9), torch.zeros(8))
    nonzero = (probs > 0).sum(-1).tolist()
    assert nonzero[0] == 4  # top_k 4
    # top_k 2 over a three-way tie: the C draw (a CPU) keeps every token tied at the cut, alone
    # or in any batch; torch's draws alone from torch.topk(2)'s two, and keeps all three in a
    # batch that needs a full sort. Either way target_probs follows the draw
    # (test_target_probs_match_sampler_frequencies).
    assert nonzero[7] == 3
    alone = sampler.target_probs(logits[8:9], t([8]), t([0]))[0]
    kept = 3 if cpu_sampling.available(torch.device("cpu")) else 2
    assert (alone > 0).sum() == kept and alone.max() == pytest.approx(1 / kept)
    assert probs[6, EOS] == 0  # min_new_tokens bans eos
    assert probs[5].tolist().count(1.0) == 1  # greedy row: one-hot
    # min_p: every kept token has probability >= min_p * the most likely one's.
    kept = probs[2][probs[2] > 0]
    assert kept.min() >= 0.2 * kept.max() - 1e-6
    assert sampler.target_probs(logits[:0], t([], dtype=torch.long), t([])).shape == (0, VOCAB)


def test_root_only_accept_draws_like_the_sampler():
    """With no drafts the bonus uses the sampler's own noise: the same token as `sample`."""
    state, sampler, logits = sampler_setup()
    slots = t([1, 2, 3, 4, 5, 7, 8]).repeat(300)
    rows = logits[slots]
    positions = torch.arange(len(slots)) + 17
    sampled = sampler.sample(rows, slots, positions).token_ids
    probs = sampler.target_probs(rows, slots, positions)
    tree = chain_tree(torch.zeros(len(slots), dtype=torch.long),
                      torch.zeros(len(slots), 0, dtype=torch.long))
    seeds = torch.from_numpy(state.seeds[slots.numpy()])
    res = accept_sampling(tree, probs[:, None], seeds, positions[:, None])
    assert (res.bonus_tokens != sampled).float().mean() < 0.002
