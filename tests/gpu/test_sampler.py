"""Sampler tests on plain tensors: every check compares against a naive reference written here
(a per-row Python/numpy implementation, softmax, a chi-square test), never against the sampler."""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import numpy as np
import pytest
import torch

from gpu.sampler import Sampler
from gpu.sampling_state import SamplingState
from gpu.seeded_random import seeded_uniform
from ipc.sampling import SamplingParams

P = SamplingParams



@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """These tensors are small: one thread avoids OpenMP barrier stalls."""


def make(vocab: int, num_slots: int = 40, eos=()) -> tuple[SamplingState, Sampler]:
    state = SamplingState(num_slots, vocab, "cpu", eos_token_ids=eos)
    return state, Sampler(state)


def rows(*slots) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Naive references.


def naive_allowed(logits_row: torch.Tensor, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """HF order: temperature, top-k, top-p (on the renormalised survivors), min-p. Returns the
    allowed ids and their renormalised probabilities, in float64."""
    s = logits_row.double().numpy() / (p.temperature or 1.0)
    keep = np.argsort(-s, kind="stable")
    if p.top_k > 0:
        keep = keep[: p.top_k]

    def probs(ids):
        e = np.exp(s[ids] - s[ids].max())
        return e / e.sum()

    if p.top_p < 1.0:
        q = probs(keep)
        keep = keep[(np.cumsum(q) - q) < p.top_p]
    if p.min_p > 0.0:
        q = probs(keep)
        keep = keep[q >= p.min_p * q.max()]
    return keep, probs(keep)


def naive_penalties(logits_row: torch.Tensor, prompt: list[int], outputs: list[int],
                    p: SamplingParams) -> torch.Tensor:
    out = logits_row.double().clone()
    counts = Counter(outputs)
    for tok in set(prompt) | set(outputs):
        x = out[tok].item()
        out[tok] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for tok, c in counts.items():
        out[tok] -= p.frequency_penalty * c + p.presence_penalty
    return out


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


# Pure-Python versions of the documented hash (splitmix64 keys, murmur3 fmix32 per token).
M64, M32 = (1 << 64) - 1, (1 << 32) - 1


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _fmix32(h: int) -> int:
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & M32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def reference_uniform(seed: int, position: int, token: int, stream: int = 0) -> float:
    key = _mix64((seed + (stream + 1) * 0x9E3779B97F4A7C15) & M64)
    key = _mix64((key + (position + 1) * 0x9E3779B97F4A7C15) & M64)
    h = _fmix32((((token + 1) * 0x9E3779B9) & M32) ^ (key & M32))
    top23 = h >> 9
    signed = top23 - 2**23 if top23 >= 2**22 else top23  # the kernel shifts a signed int32
    return (signed + 2**22 + 0.5) / 2**23


# ---------------------------------------------------------------------------------------------
# SamplingParams.


def test_defaults_validate_and_roundtrip():
    P().validate(49152)
    P(temperature=0, top_k=-1, seed=2**63 - 1, logprobs=20,
      stop_token_ids=[0, 49151]).validate(49152)
    params = P(temperature=0.7, stop=["\n\n"], seed=3)
    assert msgspec.json.decode(msgspec.json.encode(params), type=P) == params
    with pytest.raises(msgspec.ValidationError, match="tempreature"):
        msgspec.json.decode(b'{"tempreature": 0.5}', type=P)
    assert P(temperature=0).greedy and P(top_k=1).greedy and not P().greedy


@pytest.mark.parametrize("field, kwargs, vocab", [
    ("temperature", dict(temperature=-0.1), None),
    ("temperature", dict(temperature=math.nan), None),
    ("temperature", dict(temperature=math.inf), None),
    ("top_p", dict(top_p=0.0), None),
    ("top_p", dict(top_p=1.5), None),
    ("top_p", dict(top_p=math.nan), None),
    ("top_k", dict(top_k=-2), None),
    ("top_k", dict(top_k=101), 100),
    ("min_p", dict(min_p=-0.1), None),
    ("min_p", dict(min_p=1.1), None),
    ("repetition_penalty", dict(repetition_penalty=0.0), None),
    ("repetition_penalty", dict(repetition_penalty=-1.0), None),
    ("frequency_penalty", dict(frequency_penalty=2.5), None),
    ("presence_penalty", dict(presence_penalty=-2.1), None),
    ("logprobs", dict(logprobs=-1), None),
    ("logprobs", dict(logprobs=21), None),
    ("max_new_tokens", dict(max_new_tokens=0), None),
    ("max_new_tokens", dict(max_new_tokens=2**63, min_new_tokens=2**63), None),  # int64
    ("min_new_tokens", dict(min_new_tokens=10, max_new_tokens=5), None),
    ("min_new_tokens", dict(min_new_tokens=-1), None),
    ("stop", dict(stop=[""]), None),
    ("stop_token_ids", dict(stop_token_ids=[-1]), None),
    ("stop_token_ids", dict(stop_token_ids=[100]), 100),
    ("seed", dict(seed=-1), None),
    ("seed", dict(seed=2**63), None),
])
def test_validate_rejects(field, kwargs, vocab):
    with pytest.raises(ValueError, match=field) as err:
        P(**kwargs).validate(vocab)
    value = next(iter(kwargs.values()))
    assert repr(value) in str(err.value) or field == "min_new_tokens"


# ---------------------------------------------------------------------------------------------
# Randomness.


def test_hash_matches_python_reference():
    """Pins the documented hash and checks int64 / int32 wrap-around on this backend."""
    gen = torch.Generator().manual_seed(0)
    seeds = torch.tensor([0, 1, 2**63 - 1, 123456789012345, 7])
    positions = torch.tensor([0, 5, 10**6, 2**40, 3])
    ids = torch.randint(0, 200_000, (5, 6), generator=gen)
    for stream in (0, 1):
        got = seeded_uniform(seeds, positions, ids, stream)
        for r in range(5):
            for c in range(6):
                want = reference_uniform(int(seeds[r]), int(positions[r]), int(ids[r, c]), stream)
                assert got[r, c].item() == pytest.approx(want, abs=0), (r, c, stream)


def sample_sequence(sampler: Sampler, state: SamplingState, slot: int, steps: int, vocab: int):
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(steps):
        logits = torch.randn(1, vocab, generator=gen)
        tok = sampler.sample(logits, rows(slot), torch.tensor([100 + step])).token_ids
        state.record_outputs(rows(slot), tok)
        out.append(int(tok))
    return out


def test_same_seed_same_sequence_different_seed_differs():
    vocab = 1000
    state, sampler = make(vocab)
    state.set_request(3, P(seed=42))
    first = sample_sequence(sampler, state, 3, 50, vocab)
    state.set_request(7, P(seed=42))  # another slot, same seed
    assert sample_sequence(sampler, state, 7, 50, vocab) == first
    state.set_request(3, P(seed=43))
    other = sample_sequence(sampler, state, 3, 50, vocab)
    assert sum(a != b for a, b in zip(first, other)) > 40
    state.set_request(3, P())  # no seed: one is drawn per request
    seed_a = int(state.seeds[3])
    state.set_request(3, P())
    assert int(state.seeds[3]) != seed_a


OTHERS = [P(temperature=0), P(), P(top_k=5), P(top_p=0.8), P(min_p=0.1), P(top_k=50, top_p=0.9),
          P(temperature=0.5, repetition_penalty=1.3), P(temperature=0, presence_penalty=1.0),
          P(top_k=1), P(temperature=1.5, top_p=0.5), P(logprobs=3), P(top_k=300),
          P(frequency_penalty=0.5), P(temperature=0.3, min_p=0.2), P(top_p=0.99)]


@pytest.mark.parametrize("target", [
    P(seed=11), P(seed=12, temperature=0.7, top_k=20), P(seed=13, top_p=0.9),
    P(seed=14, min_p=0.05), P(seed=15, top_k=40, top_p=0.8, min_p=0.02, logprobs=2),
    P(seed=16, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4),
])
def test_alone_equals_inside_shuffled_batches(target):
    """Same request, same logits: identical tokens alone and inside batches of up to 16 whose
    composition and order change every step (so the batch takes different sampler paths)."""
    vocab, steps = 5000, 12
    prompt = [5, 17, 17, 300]
    gen = torch.Generator().manual_seed(2)
    target_logits = [torch.randn(vocab, generator=gen) * 2 for _ in range(steps)]

    alone_state, alone = make(vocab)
    alone_state.set_request(9, target, prompt)
    alone_out, alone_lp = [], []
    for step in range(steps):
        out = alone.sample(target_logits[step][None], rows(9), torch.tensor([50 + step]))
        alone_state.record_outputs(rows(9), out.token_ids)
        alone_out.append(int(out.token_ids[0]))
        alone_lp.append(None if out.logprobs is None else float(out.logprobs[0]))

    state, sampler = make(vocab)
    other_slots = [s for s in range(2, 18) if s != 11]
    for slot, params in zip(other_slots, OTHERS):
        state.set_request(slot, msgspec.structs.replace(params, seed=slot), [1, 2, 3])
    state.set_request(11, target, prompt[:2])
    state.add_prompt_tokens(11, torch.tensor(prompt[2:]))  # a second prefill chunk
    batched_out, batched_lp = [], []
    for step in range(steps):
        chosen = [s for s in other_slots if torch.rand(1, generator=gen) < 0.7] + [11]
        order = torch.randperm(len(chosen), generator=gen)
        slots = torch.tensor(chosen)[order]
        logits = torch.randn(len(chosen), vocab, generator=gen) * 2
        where = int((slots == 11).nonzero())
        logits[where] = target_logits[step]
        positions = torch.randint(0, 1000, (len(chosen),), generator=gen)
        positions[where] = 50 + step
        out = sampler.sample(logits, slots, positions)
        state.record_outputs(slots, out.token_ids)
        batched_out.append(int(out.token_ids[where]))
        batched_lp.append(None if out.logprobs is None else float(out.logprobs[where]))
    assert batched_out == alone_out
    if target.logprobs is not None:
        assert batched_lp == pytest.approx(alone_lp, abs=1e-5)


# ---------------------------------------------------------------------------------------------
# Filters and distributions.


def peaked_logits(vocab: int, head: list[float], tail_mass: float, perm_seed: int) -> torch.Tensor:
    """Logits whose softmax puts `head` on a few tokens and a gently falling tail on the rest,
    shuffled so token order carries no information."""
    tail = np.linspace(1.0, 0.5, vocab - len(head))
    probs = np.concatenate([head, tail / tail.sum() * tail_mass])
    perm = np.random.default_rng(perm_seed).permutation(vocab)
    out = np.empty(vocab)
    out[perm] = np.log(probs)
    return torch.tensor(out, dtype=torch.float32)


FILTER_CASES = [
    P(top_k=3), P(top_k=2, top_p=0.5), P(top_p=0.7), P(top_p=0.95), P(min_p=0.3),
    P(temperature=0.5, top_p=0.8), P(top_k=30, top_p=0.9, min_p=0.01),
    P(temperature=2.0, min_p=0.55),
]


@pytest.mark.parametrize("vocab", [50, 5000])  # 5000: the CPU top-256 / top-4096 candidate path
@pytest.mark.parametrize("batch", ["each_alone", "mixed"])
def test_filters_never_emit_excluded_tokens(vocab, batch):
    head = [0.4, 0.25, 0.15, 0.1]
    logits_row = peaked_logits(vocab, head, 0.1, perm_seed=vocab)
    state, sampler = make(vocab)
    for slot, params in enumerate(FILTER_CASES, start=1):
        state.set_request(slot, msgspec.structs.replace(params, seed=slot))
    draws = 1500 if vocab < 1000 else 400
    groups = ([list(range(1, len(FILTER_CASES) + 1))] if batch == "mixed"
              else [[s] for s in range(1, len(FILTER_CASES) + 1)])
    for group in groups:
        slots = torch.tensor(group).repeat_interleave(draws)
        positions = torch.arange(draws).repeat(len(group))
        out = sampler.sample(logits_row.expand(len(slots), vocab), slots, positions).token_ids
        for slot in group:
            params = FILTER_CASES[slot - 1]
            allowed, _ = naive_allowed(logits_row, params)
            emitted = set(out[slots == slot].tolist())
            assert emitted <= set(allowed.tolist()), (params, emitted - set(allowed.tolist()))
            if len(allowed) <= 10:  # small sets: every allowed token shows up
                assert emitted == set(allowed.tolist()), params


@pytest.mark.parametrize("params, mix_with", [
    (P(), None),                      # temperature only: whole-vocabulary draw
    (P(temperature=0.5), None),
    (P(temperature=2.0), None),
    (P(top_k=6), None),               # topk path
    (P(top_p=0.8), None),             # sorted path
    (P(min_p=0.1), None),
    (P(top_k=7, top_p=0.9), P()),     # thresholds with a whole-vocabulary draw
])
def test_empirical_distribution_matches_softmax(params, mix_with):
    vocab, draws = 10, 20000
    logits_row = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.5, 0.0, -0.3, -0.7, -1.0, -2.0])[
        torch.randperm(vocab, generator=torch.Generator().manual_seed(3))]
    state, sampler = make(vocab)
    state.set_request(1, msgspec.structs.replace(params, seed=1234))
    slots = torch.ones(draws, dtype=torch.long)
    if mix_with is not None:
        state.set_request(2, mix_with)
        slots[::2] = 2
    out = sampler.sample(logits_row.expand(draws, vocab), slots,
                         torch.arange(draws)).token_ids[slots == 1]
    allowed, probs = naive_allowed(logits_row, params)
    counts = np.bincount(out.numpy(), minlength=vocab)
    assert counts.sum() == counts[allowed].sum()
    assert chi_square_pvalue(counts[allowed], probs) > 1e-4


def test_draws_across_seeds_match_softmax():
    vocab, draws = 8, 8000
    logits_row = torch.linspace(1.0, -1.0, vocab)
    state, sampler = make(vocab, num_slots=draws + 1)
    for slot in range(1, draws + 1):
        state.set_request(slot, P(seed=slot))
    out = sampler.sample(logits_row.expand(draws, vocab), torch.arange(1, draws + 1),
                         torch.full((draws,), 7)).token_ids
    counts = np.bincount(out.numpy(), minlength=vocab)
    assert chi_square_pvalue(counts, torch.softmax(logits_row.double(), 0).numpy()) > 1e-4


def test_temperature_sharpens_and_flattens():
    vocab, draws = 10, 10000
    logits_row = torch.linspace(2.0, -2.0, vocab)
    freq_top = []
    for t in (0.5, 1.0, 2.0):
        state, sampler = make(vocab)
        state.set_request(1, P(temperature=t, seed=5))
        out = sampler.sample(logits_row.expand(draws, vocab), torch.ones(draws, dtype=torch.long),
                             torch.arange(draws)).token_ids
        freq_top.append(float((out == 0).float().mean()))
        expected = torch.softmax(logits_row.double() / t, 0)[0].item()
        assert abs(freq_top[-1] - expected) < 0.02
    assert freq_top[0] > freq_top[1] > freq_top[2]


def test_extreme_valid_params_neither_crash_nor_sample_garbage():
    """Values the float32 / int64 tables cannot hold as such: a tiny temperature overflowed
    logits / T to inf (token 0 every time), a top_p rounding to 0 kept no token (an index error
    that killed the worker), a min_new_tokens of 2**63 overflowed int64. The tiny ones are
    greedy; the largest valid min_new_tokens fits."""
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    state, sampler = make(vocab, num_slots=5, eos=[2])
    for slot, params in enumerate([P(temperature=1e-300, seed=1), P(top_p=1e-300, seed=2),
                                   P(temperature=1e-9, top_p=1e-45, logprobs=2),
                                   P(max_new_tokens=2**63 - 1, min_new_tokens=2**63 - 1)], 1):
        state.set_request(slot, params)
    out = sampler.sample(logits, torch.arange(1, 5), torch.arange(4))
    assert torch.equal(out.token_ids[:3], logits.argmax(-1)[:3])
    assert out.logprobs is not None and bool(out.logprobs.isfinite().all())
    assert out.token_ids[3] != 2  # eos is banned for the next 2**63 - 1 tokens


def test_greedy_rows_take_argmax():
    vocab, bs = 1000, 64
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(4))
    state, sampler = make(vocab, num_slots=bs + 1)
    for slot in range(1, bs + 1):
        kind = slot % 4
        params = [P(temperature=0), P(top_k=1, temperature=0.9), P(seed=slot), P(top_p=0.5)][kind]
        state.set_request(slot, params)
    slots = torch.arange(1, bs + 1)
    out = sampler.sample(logits, slots, torch.arange(bs)).token_ids
    greedy = (slots % 4) < 2
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    for slot in range(1, bs + 1):  # all greedy: the fast path, any dtype
        state.set_request(slot, P(temperature=0))
    assert torch.equal(sampler.sample(logits, slots, torch.arange(bs)).token_ids, logits.argmax(-1))
    bf16 = logits.bfloat16()
    assert torch.equal(sampler.sample(bf16, slots, torch.arange(bs)).token_ids, bf16.argmax(-1))


def test_empty_batch():
    state, sampler = make(100)
    out = sampler.sample(torch.empty(0, 100), rows(), rows())
    assert out.token_ids.shape == (0,)


# ---------------------------------------------------------------------------------------------
# Penalties, counts, logprobs, min_new_tokens.


PENALTY_CASES = [
    P(repetition_penalty=1.3), P(repetition_penalty=0.7), P(frequency_penalty=0.8),
    P(presence_penalty=-1.5),
    P(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
    P(),  # no penalties, in a batch that has them: unchanged
]


def test_penalties_match_naive_formulas():
    vocab = 64
    gen = torch.Generator().manual_seed(5)
    state, sampler = make(vocab)
    prompts, outputs = {}, {}
    for slot, params in enumerate(PENALTY_CASES, start=1):
        prompts[slot] = torch.randint(0, vocab, (10,), generator=gen).tolist()
        state.set_request(slot, params, prompts[slot][:6])
        state.add_prompt_tokens(slot, prompts[slot][6:])
        outputs[slot] = []
    slots = torch.arange(1, len(PENALTY_CASES) + 1)
    for _ in range(8):  # a slot may repeat within one call (accepted drafts)
        batch = torch.cat([slots, slots[:3]])
        toks = torch.randint(0, 20, (len(batch),), generator=gen)
        state.record_outputs(batch, toks)
        for s, t in zip(batch.tolist(), toks.tolist()):
            outputs[s].append(t)
    logits = torch.randn(len(slots), vocab, generator=gen) * 3
    flags = sampler.batch_flags(slots)
    got = sampler.process_logits(logits, slots, flags)
    for i, slot in enumerate(slots.tolist()):
        want = naive_penalties(logits[i], prompts[slot], outputs[slot], PENALTY_CASES[slot - 1])
        torch.testing.assert_close(got[i].double(), want, rtol=1e-6, atol=1e-5)
        assert int(state.generated_len[slot]) == len(outputs[slot])
        want_counts = np.bincount(outputs[slot], minlength=vocab)
        assert np.array_equal(state.output_counts[slot].numpy(), want_counts)


def test_logprobs_are_log_softmax_of_processed_logits():
    vocab = 20  # logprobs=20 covers the whole vocabulary
    gen = torch.Generator().manual_seed(6)
    cases = [P(temperature=0.7, logprobs=20, repetition_penalty=1.5, presence_penalty=0.3),
             P(temperature=0, logprobs=5, frequency_penalty=1.0),  # greedy: T = 1
             P(top_k=3, logprobs=0), P(top_p=0.5, temperature=1.3, logprobs=20), P()]
    state, sampler = make(vocab)
    prompt = [1, 2, 3]
    for slot, params in enumerate(cases, start=1):
        state.set_request(slot, params, prompt)
    slots = torch.arange(1, len(cases) + 1)
    state.record_outputs(slots, torch.full((len(cases),), 4))
    logits = torch.randn(len(cases), vocab, generator=gen) * 2
    out = sampler.sample(logits, slots, torch.arange(len(cases)))
    assert out.top_logprobs.shape == (len(cases), 20)
    for i, params in enumerate(cases):
        processed = naive_penalties(logits[i], prompt, [4], params) / (params.temperature or 1.0)
        ref = torch.log_softmax(processed, 0)
        if params.logprobs is None:
            continue
        assert out.logprobs[i].item() == pytest.approx(ref[out.token_ids[i]].item(), abs=1e-5)
        n = params.logprobs
        top = out.top_logprobs[i, :n].double()
        assert torch.all(top[:-1] >= top[1:]) if n > 1 else True
        torch.testing.assert_close(top, ref.sort(descending=True).values[:n], atol=1e-5, rtol=0)
        torch.testing.assert_close(ref[out.top_logprob_ids[i, :n]], top, atol=1e-5, rtol=0)
    state.set_request(1, P(logprobs=0))
    out = sampler.sample(logits[:1], rows(1), rows(0))
    assert out.logprobs is not None and out.top_logprobs is None
    state.set_request(1, P())
    assert sampler.sample(logits[:1], rows(1), rows(0)).logprobs is None


def test_min_new_tokens_blocks_eos_and_stop_ids():
    vocab, eos, stop_id = 30, 2, 7
    state, sampler = make(vocab, eos=[eos])
    logits = torch.zeros(2, vocab)
    logits[:, eos], logits[:, stop_id], logits[:, 11] = 10.0, 9.0, 8.0
    state.set_request(1, P(temperature=0, min_new_tokens=3, stop_token_ids=[stop_id]))
    state.set_request(2, P(temperature=0, min_new_tokens=3, ignore_eos=True))
    slots = rows(1, 2)
    seen = []
    for step in range(4):
        tok = sampler.sample(logits, slots, torch.tensor([step, step])).token_ids
        state.record_outputs(slots, tok)
        seen.append(tok.tolist())
    assert seen == [[11, eos]] * 3 + [[eos, eos]]
