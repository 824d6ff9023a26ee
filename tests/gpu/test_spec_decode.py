"""EAGLE speculative decoding end to end through the offline Engine (the real spec path).

Greedy output with speculation must be token-identical to the plain engine's, whatever the
head drafts: chain and tree, overlap on and off, the shipped EAGLE-3 head (which gets drafts
accepted, so multi-token steps and tree KV compaction run) and random EAGLE-3 / EAGLE-1 heads
(the Triton backend's spec step: test_window_spec_deterministic.py, on a tiny model).
Sampling must follow the target's distribution, and idle plans must run the spec path.
Accounting returns to its initial state after every scenario.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gpu.eagle.accept as accept_mod
from fmserve.engine import Engine
from gpu.eagle.accept import accept_verified
from gpu.eagle.drafter import Drafter
from gpu.eagle.eagle_step import hidden_size_for
from gpu.eagle.tree import chain_tree
from gpu.eagle.head_io import random_draft_head, save_draft_head
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings, accept_length
from ipc.worker_messages import StepPlan, pack_i32, unpack_i32
from tests.engine_runs import RequestRun, assert_accounting_empty, run_requests
from tests.gpu.spec_runs import CHAIN, QUESTIONS, TREE, make_engine, scenario


def run(engine: Engine, overlap: bool, abort_rid_index: int | None = None
        ) -> tuple[list[tuple], list[RequestRun]]:
    """QUESTIONS through the engine: what clients see per request, and the full runs (with
    the spec counters)."""
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = run_requests(engine, chats, scenario(), overlap, abort_index=abort_rid_index,
                        abort_after=4)
    return [r.visible for r in runs], runs


@pytest.fixture(scope="module")
def plain(model_path):
    return make_engine(model_path)


@pytest.fixture(scope="module")
def reference(plain):
    rows, _ = run(plain, overlap=False)
    return rows


@pytest.fixture(scope="module")
def random_heads(plain, tmp_path_factory):
    """Random EAGLE-3 (reduced vocabulary) and EAGLE-1 heads for the default model, and an
    EAGLE-3 head with a wider MLP than the target's (train-eagle --head-intermediate-size)."""
    state = plain.worker.state
    mc, embed = state.model_config, state.model.embed_tokens
    out = {}
    for name, algorithm, vocab, width in (("eagle3", "eagle3", 4096, None),
                                          ("eagle", "eagle", None, None),
                                          ("eagle3-wide", "eagle3", 4096, 2048)):
        head = random_draft_head(mc, embed, embed, algorithm, draft_vocab_size=vocab, seed=3,
                                 intermediate_size=width)
        path = tmp_path_factory.mktemp(f"random-{name}")
        save_draft_head(head, path)
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def chain_engine(model_path):
    return make_engine(model_path, CHAIN)


@pytest.fixture(scope="module")
def tree_engine(model_path):
    return make_engine(model_path, TREE)


_SHIPPED_RUNS: dict[tuple[str, bool], tuple[list[tuple], list[RequestRun]]] = {}


def shipped_run(request, shape: str, overlap: bool) -> tuple[list[tuple], list]:
    """The scenario through the shipped head, once per (shape, overlap) in this module."""
    key = (shape, overlap)
    if key not in _SHIPPED_RUNS:
        _SHIPPED_RUNS[key] = run(request.getfixturevalue(f"{shape}_engine"), overlap)
    return _SHIPPED_RUNS[key]


def mean_accept_length(runs: list[RequestRun]) -> float:
    return accept_length(sum(r.accepted_drafts for r in runs), sum(r.verify_steps for r in runs))


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_identical_with_shipped_head(request, reference, shape, overlap):
    rows, counters = shipped_run(request, shape, overlap)
    assert rows == reference
    assert sum(r.verify_steps for r in counters) > 0
    # The trained head gets drafts accepted, so multi-token steps (and, for the tree, KV
    # compaction of off-column paths) are exercised, not just the bonus-only path.
    assert sum(r.accepted_drafts for r in counters) > 0, counters


@pytest.mark.parametrize("head", ["eagle3", "eagle", "eagle3-wide"])
def test_greedy_identical_with_random_head(request, model_path, reference, random_heads, head):
    algorithm = head.split("-")[0]
    spec = SpecSettings(algorithm, random_heads[head], num_steps=TREE.num_steps,
                        topk=TREE.topk, num_draft_tokens=TREE.num_draft_tokens,
                        disable_above_batch_size=0)
    engine = make_engine(model_path, spec)
    if head == "eagle3-wide":
        assert engine.worker.step.head.config.intermediate_size == 2048
    rows, counters = run(engine, overlap=True)
    assert rows == reference
    if head == "eagle3":  # the shipped head drafts far better than chance
        _, shipped = shipped_run(request, "tree", True)
        assert mean_accept_length(shipped) > mean_accept_length(counters) + 0.1, (shipped,
                                                                                  counters)


def test_abort_mid_stream_frees_everything(tree_engine, reference):
    rows, _ = run(tree_engine, overlap=True, abort_rid_index=5)
    assert rows[5][2] == "abort"
    assert rows[:5] == reference[:5]


def test_idle_plans_run_the_spec_path(chain_engine, tree_engine, plain):
    for engine in (chain_engine, tree_engine):
        worker = engine.worker
        assert hidden_size_for(worker.step) == 3 * worker.state.model_config.hidden_size  # EAGLE-3
        assert hidden_size_for(plain.worker.step) == worker.state.model_config.hidden_size
        empty = StepPlan(step_id=10_000, new_requests=[], grants=[], extends=[],
                         decode_slots=pack_i32(np.zeros(0)), released_slots=pack_i32(np.zeros(0)))
        result = worker.run_step(empty)
        assert len(unpack_i32(result.slots)) == 0
        assert len(unpack_i32(result.token_ids)) == 0
        assert len(unpack_i32(result.accept_lens)) == 0
        # Serving still works after idle steps.
        out = engine.generate([[{"role": "user", "content": "Say hi."}]],
                              SamplingParams(temperature=0.0, max_new_tokens=3))
        assert len(out[0].token_ids) == 3
        assert_accounting_empty(engine)


def test_all_finished_batch_under_overlap(tree_engine, reference):
    """Every request stops at its first verify step (on a stop token the scheduler cannot see
    coming) while the next plan is already in flight: that step runs for requests that are
    gone, and its results are dropped once."""
    engine = tree_engine
    engine.overlap = True
    stale = engine.scheduler.core.num_stale_results
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[1:4]]
    refs = [r[0] for r in reference[1:4]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=[ref[1]])
              for ref in refs]
    out = engine.generate(chats, params)
    for c, ref in zip(out, refs):
        assert c.finish_reason.value == "stop"
        assert c.token_ids == ref[:len(c.token_ids)] and 1 <= len(c.token_ids) <= 2
    assert engine.scheduler.core.num_stale_results > stale
    assert_accounting_empty(engine)


# ---------------------------------------------------------------------------------------------
# Sampling through the real model: the second emitted token is the first one a verify step
# decides. With a deliberately poor draft (always the same, unlikely token) its distribution
# must still be the target's; breaking the acceptance rule on purpose must be detected.

SAMPLING = dict(temperature=1.0, top_k=6, max_new_tokens=2)
NUM_SEEDS = 480
# The broken rule puts nearly every second token on the poor draft's: one wave of seeds shows it.
BROKEN_SEEDS = 120


def _chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; categories with an expected count under 5 are pooled."""
    expected = probs / probs.sum() * counts.sum()
    order = np.argsort(expected)
    pooled_c, pooled_e, acc_c, acc_e = [], [], 0.0, 0.0
    for i in order:
        acc_c, acc_e = acc_c + counts[i], acc_e + expected[i]
        if acc_e >= 5:
            pooled_c.append(acc_c)
            pooled_e.append(acc_e)
            acc_c = acc_e = 0.0
    if acc_e and pooled_e:
        pooled_c[-1] += acc_c
        pooled_e[-1] += acc_e
    c, e = np.array(pooled_c), np.array(pooled_e)
    stat = float(((c - e) ** 2 / e).sum())
    df = len(c) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def sampling_engine(model_path):
    """A chain engine wide enough to run every seed in a few batches."""
    return make_engine(model_path, CHAIN, max_running_requests=NUM_SEEDS // 4,
                       max_tokens_per_step=2048)


@pytest.fixture(scope="module")
def sampling_setup(plain):
    """The prompt, the most likely first token, and the target's top-k distribution after it."""
    prompt = plain.tokenizer.encode("The capital of France is")
    first = _target_probs(plain, prompt).argmax().item()
    probs = _target_probs(plain, prompt + [first])
    # The poor draft: the least likely token still inside the top-k support.
    support = probs.nonzero().flatten()
    poor = support[probs[support].argmin()].item()
    return prompt, first, probs.numpy(), poor


def _target_probs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Temperature-1, top-k filtered next-token distribution of the plain model after ids."""
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=1,
                                                logprobs=SAMPLING["top_k"]))
    top = out[0].logprobs[0].top  # (token id, logprob) of the raw distribution, best first
    probs = torch.zeros(engine.worker.state.model_config.vocab_size, dtype=torch.float64)
    p = torch.tensor([lp for _, lp in top], dtype=torch.float64).exp()
    probs[torch.tensor([t for t, _ in top])] = p / p.sum()
    return probs


def _second_token_counts(engine: Engine, setup, monkeypatch, seeds: int = NUM_SEEDS
                         ) -> tuple[np.ndarray, int]:
    prompt, first, probs, poor = setup

    def poor_draft(self, hidden):
        n = hidden.shape[0]
        p = torch.ones(n, self.settings.topk, device=hidden.device)
        ids = torch.full((n, self.settings.topk), poor, dtype=torch.long, device=hidden.device)
        return p, ids

    monkeypatch.setattr(Drafter, "topk", poor_draft)
    params = [SamplingParams(seed=1000 + i, **SAMPLING) for i in range(seeds)]
    out = engine.generate([prompt] * seeds, params)
    seconds = [c.token_ids[1] for c in out if c.token_ids[0] == first and len(c.token_ids) > 1]
    verify = sum(c.spec_verify_steps for c in out)
    assert_accounting_empty(engine)
    return np.bincount(seconds, minlength=len(probs)).astype(np.float64), verify


def test_sampling_follows_target_with_poor_draft(sampling_engine, sampling_setup, monkeypatch):
    _, _, probs, poor = sampling_setup
    counts, verify = _second_token_counts(sampling_engine, sampling_setup, monkeypatch)
    assert verify > 0 and counts.sum() > 100, (verify, counts.sum())
    assert counts[probs == 0].sum() == 0  # nothing outside the top-k support
    support = probs > 0
    p = _chi_square_pvalue(counts[support], probs[support])
    assert p > 1e-3, (p, counts[support], probs[support] * counts.sum())


def test_broken_acceptance_rule_is_detected(sampling_engine, sampling_setup, monkeypatch):
    """Accepting every draft the target allows (p > 0) skews the distribution to the poor
    draft's token: the same statistic must reject it."""
    _, _, probs, poor = sampling_setup
    monkeypatch.setattr(accept_mod, "_accept_probability",
                        lambda p_tok, remaining: torch.where(p_tok > 0, 1.0, 0.0))
    counts, _ = _second_token_counts(sampling_engine, sampling_setup, monkeypatch,
                                     BROKEN_SEEDS)
    assert counts.sum() > 30, counts.sum()
    support = probs > 0
    p = _chi_square_pvalue(counts[support], probs[support])
    assert p < 1e-3 or math.isnan(p), (p, counts[support])
    assert counts[poor] > 0.9 * counts.sum()


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_logprobs_under_speculation_are_the_plain_engines(request, plain, shape):
    """A request that asks for logprobs gets one per token under speculation too (they came
    back empty): each emitted token's, and the top 2, from the logits of the tree node it
    follows, as plain decoding reports them. A request beside it that asks none gets none; a
    sampled one gets one finite logprob per token."""
    engine = request.getfixturevalue(f"{shape}_engine")
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=16, logprobs=2),
              SamplingParams(temperature=0.0, max_new_tokens=16),
              SamplingParams(temperature=0.8, seed=4, max_new_tokens=16, logprobs=0)]
    want = plain.generate(chats, params)
    got = engine.generate(chats, params)
    assert got[0].token_ids == want[0].token_ids
    assert len(got[0].logprobs) == len(got[0].token_ids) > 4
    for a, b in zip(got[0].logprobs, want[0].logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        for (_, x), (_, y) in zip(a.top, b.top):
            assert x == pytest.approx(y, abs=2e-3)
    assert got[1].logprobs == [] and got[1].token_ids == want[1].token_ids
    assert len(got[2].logprobs) == len(got[2].token_ids) > 0
    assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 and lp.top == []
               for lp in got[2].logprobs)
    assert_accounting_empty(engine)


# ----- min_new_tokens and penalties in verify -----
# EAGLE verify with min_new_tokens and penalties: a tree node deep in the draft samples the
# token that follows the drafts above it, so the eos ban and the penalty counts it sees must
# include those drafts, exactly as plain decoding would have counted them by then.

CHAT = [{"role": "user", "content": "Name three colors."}]


def make_two_slot_engine(model_path, spec=None) -> Engine:
    return Engine(model=str(model_path), dtype="fp32", page_size=16, max_kv_tokens=2048,
                  max_running_requests=2, progress=False, spec=spec)


def test_min_new_tokens_lets_eos_through_at_the_same_token_under_speculation(model_path):
    # The answer ends with eos at token K. With min_new_tokens = K - 1 eos is allowed at token
    # K, so plain decoding still stops there. Verify used to ban eos at every node of a step
    # that started before min_new_tokens, so an eos drafted deeper in that step was rejected
    # and the request ran on to max_new_tokens.
    plain, spec = make_two_slot_engine(model_path), make_two_slot_engine(model_path, CHAIN)
    free = plain.generate([CHAT], SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    assert free.finish_reason.value == "stop", "the scenario needs an answer that ends by eos"
    # Banning eos where it was not the argmax leaves plain greedy decoding as it was.
    params = SamplingParams(temperature=0.0, max_new_tokens=16,
                            min_new_tokens=len(free.token_ids) - 1)
    got = spec.generate([CHAT], params)[0]
    assert (got.token_ids, got.finish_reason) == (free.token_ids, free.finish_reason)
    assert got.spec_accepted_drafts > 0  # drafts were accepted: verify decided some tokens
    assert_accounting_empty(spec)


# -- verify's acceptance on hand-made logits, through the real sampler state -----------------

VOCAB, A, B, ROOT, EOS = 16, 5, 6, 7, 2


@pytest.fixture(scope="module")
def spec_runner(tiny_llama, tmp_path_factory):
    """A worker with a random EAGLE-1 head on tiny_llama: only its sampler state and
    accept_verified are used, with logits made here."""
    from gpu.eagle.head_io import random_draft_head, save_draft_head
    from gpu.worker import Worker
    from ipc.worker_config import worker_config

    tiny = dict(model_path=str(tiny_llama), dtype="fp32", max_kv_tokens=256,
                max_running_requests=4, progress=False)
    base = Worker(worker_config(**tiny)).state
    head = random_draft_head(base.model_config, base.model.embed_tokens,
                             base.model.embed_tokens, "eagle", seed=1)
    path = tmp_path_factory.mktemp("tiny-head")
    save_draft_head(head, path)
    spec = SpecSettings("eagle", str(path), num_steps=3, topk=1, num_draft_tokens=4,
                        disable_above_batch_size=0)
    return Worker(worker_config(**tiny, spec=spec))


def verify(runner, params: SamplingParams, drafts: list[int], logits: torch.Tensor,
           generated: list[int]) -> list[int]:
    """Slot 1 runs `params` and has generated `generated`; a chain root -> drafts is verified
    against `logits` [len(drafts) + 1, vocab]. Returns the emitted tokens."""
    state = runner.state.sampling_state
    device = runner.state.device  # the worker's own: a CUDA GPU where there is one
    state.set_request(1, params, [])
    slots = torch.tensor([1], device=device)
    if generated:
        state.record_outputs(slots.repeat(len(generated)), torch.tensor(generated, device=device))
    tree = chain_tree(torch.tensor([ROOT], device=device), torch.tensor([drafts], device=device))
    positions = torch.arange(len(drafts) + 1, device=device)[None, :] + 10
    flags = runner.state.sampler.batch_flags(slots, np.array([1]))
    result = accept_verified(runner.state.sampler, state, tree, logits.to(device), slots,
                             np.array([1]), positions, flags)
    out = result.accepted_tokens[0]
    return out[out >= 0].tolist()


def chain_logits(vocab: int, favourites: list[tuple[int, float]]) -> torch.Tensor:
    """One row per node: 1.0 everywhere but the (token, logit) favoured there."""
    logits = torch.ones(len(favourites), vocab)
    for row, (token, value) in enumerate(favourites):
        logits[row, token] = value
    return logits


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_a_draft_accepted_earlier_in_the_step_counts_for_the_penalty(spec_runner, greedy):
    # Every node favours A by 1.5 over B. Plain decoding emits A, then (A's count 1, penalty 2)
    # B. Verify used to score every node with the counts from before the step, so it accepted
    # A, A, A: the frequency penalty missed the drafts accepted above each node.
    vocab = spec_runner.state.sampling_state.vocab_size
    # Seeded: at temperature 0.05 the 1.5 lead (and, after the penalty, the 0.5 loss) is
    # decisive, so rejection sampling must give the same tokens.
    params = SamplingParams(temperature=0.0 if greedy else 0.05, frequency_penalty=2.0, seed=3)
    logits = chain_logits(vocab, [(A, 4.0)] * 4)
    logits[:, B] = 2.5
    emitted = verify(spec_runner, params, [A, A, A], logits, generated=[])
    assert emitted == [A, B]


def test_min_new_tokens_counts_the_drafts_above_a_node(spec_runner):
    # Two tokens generated, min_new_tokens 3: the root samples token 3 (eos banned), the
    # first draft's node samples token 4, where eos is allowed, as plain decoding allows it.
    vocab = spec_runner.state.sampling_state.vocab_size
    params = SamplingParams(temperature=0.0, min_new_tokens=3)
    logits = chain_logits(vocab, [(EOS, 9.0), (EOS, 9.0), (A, 9.0), (A, 9.0)])
    logits[0, A] = 5.0  # with eos banned the root's choice is A
    emitted = verify(spec_runner, params, [A, EOS, B], logits, generated=[3, 4])
    assert emitted == [A, EOS, A]
