"""A request's penalties and min_new_tokens see its whole history, whatever the cache did
with it.

The worker's sampling state learns a request's tokens from the prefill chunks it runs. Two
paths skip some of them: a prefix-cache hit (the borrowed prefix is never prefilled again) and
a retraction (the request comes back with its earlier outputs as part of its prefill). Greedy
outputs under repetition / frequency / presence penalties must not depend on either, nor may
where min_new_tokens lets a stop token through."""

from __future__ import annotations

from fmserve.engine import Engine
from ipc.sampling import SamplingParams
from tests.engine_runs import assert_accounting_empty

PROMPTS = [[1] + [(7 * i + 3 * k) % 90 + 5 for k in range(6 + i)] for i in range(6)]


def make_engine(tiny_llama, max_kv_tokens: int = 4096, **opts) -> Engine:
    return Engine(model=str(tiny_llama), dtype="fp32", page_size=4, max_kv_tokens=max_kv_tokens,
                  max_running_requests=6, max_tokens_per_step=64, progress=False, **opts)


def test_frequency_and_presence_penalties_survive_a_retraction(tiny_llama):
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True,
                            frequency_penalty=1.0, presence_penalty=0.5)
    want = [c.token_ids for c in make_engine(tiny_llama).generate(PROMPTS, params)]
    # The penalties must shape these outputs, or the comparison below proves nothing.
    plain = make_engine(tiny_llama).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    assert [c.token_ids for c in plain] != want
    tight = make_engine(tiny_llama, 4 * 10)  # 9 pages: 2-3 requests at a time
    got = [c.token_ids for c in tight.generate(PROMPTS, params)]
    assert tight.scheduler.core.num_retractions > 0, "the test no longer exercises retraction"
    assert got == want
    assert_accounting_empty(tight)


def test_repetition_penalty_covers_a_borrowed_prefix(tiny_llama):
    # A long shared prefix of tokens the suffixes never use: with the cache, the second wave
    # borrows it and prefills only its suffix, yet the penalty must still cover the prefix.
    prefix = [1] + [(5 * k) % 40 + 50 for k in range(24)]
    prompts = [prefix + [(3 * i + k) % 40 + 5 for k in range(3 + i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True,
                            repetition_penalty=1.8)
    want = [c.token_ids for c in make_engine(tiny_llama).generate(prompts, params)]
    plain = make_engine(tiny_llama).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    assert [c.token_ids for c in plain] != want
    cached = make_engine(tiny_llama, prefix_cache=True)
    cached.generate(prompts[:1], params)  # leaves the prefix's pages in the cache
    before = cached.scheduler.core.prefix_cache.hit_tokens
    got = [c.token_ids for c in cached.generate(prompts, params)]
    assert cached.scheduler.core.prefix_cache.hit_tokens - before >= len(prompts) * 16
    assert got == want


# ----- min_new_tokens across a retraction -----
# Retraction (preemption under KV pressure) recomputes a request from its prompt and the
# tokens it has generated; what it generates afterwards must be what it would have generated
# without the pressure.

MAX_NEW = 24


def first_new_token_at_or_after(tokens: list[int], start: int) -> int | None:
    return next((j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j]), None)


def test_min_new_tokens_counts_the_tokens_generated_before_a_retraction(tiny_llama):
    # Each request may stop on a token it first produces at index j >= 3, with
    # min_new_tokens = j: unconstrained it stops right there. A retracted request used to
    # come back with its count of generated tokens at zero in the worker, which then banned
    # its stop token for min_new_tokens more tokens, and it ran on to max_new_tokens.
    roomy = make_engine(tiny_llama, 4096)
    free = roomy.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                                                  ignore_eos=True))
    params, want = [], []
    for c in free:
        j = first_new_token_at_or_after(c.token_ids, 3)
        if j is None:
            params.append(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                                         ignore_eos=True))
            want.append(c.token_ids)
        else:
            params.append(SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                                         ignore_eos=True, min_new_tokens=j,
                                         stop_token_ids=[c.token_ids[j]]))
            want.append(c.token_ids[:j + 1])
    assert sum(len(w) < MAX_NEW for w in want) >= 3, "the scenario needs stops to move"
    assert [c.token_ids for c in roomy.generate(PROMPTS, params)] == want
    tight = make_engine(tiny_llama, 4 * 10)  # 9 pages: 2-3 requests at a time
    got = tight.generate(PROMPTS, params)
    assert tight.scheduler.core.num_retractions > 0, "the test no longer exercises retraction"
    assert [c.token_ids for c in got] == want
    assert_accounting_empty(tight)
