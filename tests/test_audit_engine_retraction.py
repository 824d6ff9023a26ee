"""Retraction (preemption under KV pressure) recomputes a request from its prompt and the
tokens it has generated; what it generates afterwards must be what it would have generated
without the pressure."""

from __future__ import annotations

from fmserve.engine import Engine
from ipc.sampling import SamplingParams
from tests.engine_runs import assert_accounting_empty

PROMPTS = [[1] + [(7 * i + 3 * k) % 90 + 5 for k in range(6 + i)] for i in range(6)]
MAX_NEW = 24


def make_engine(tiny_llama, max_kv_tokens: int) -> Engine:
    return Engine(model=str(tiny_llama), dtype="fp32", page_size=4, max_kv_tokens=max_kv_tokens,
                  max_running_requests=6, max_tokens_per_step=64, progress=False)


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
