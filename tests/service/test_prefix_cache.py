"""Prefix caching: the block cache on its own, the scheduler's use of it fed hand-made results,
and the real model, whose greedy tokens must not change when prompts start from cached KV."""

from __future__ import annotations

import pytest

from ipc.sampling import SamplingParams
from ipc.worker_messages import StepResult, pack_i32, unpack_i32
from service.prefix_cache import PrefixCache
from tests.service.fake_scheduler import make_core, run

PS = 4


# -- the cache alone ---------------------------------------------------------------------------

def test_release_caches_full_computed_pages_and_match_finds_the_chain():
    cache = PrefixCache(PS)
    tokens = list(range(100, 111))  # 11 tokens: pages of 4, 4, 3
    free = cache.release(tokens, [7, 8, 9], num_computed=11, borrowed=[])
    assert free == [9]  # the partial page
    assert cache.num_blocks == cache.num_evictable == 2
    assert [b.page for b in cache.match(tokens, 10)] == [7, 8]
    assert [b.page for b in cache.match(tokens, 7)] == [7]  # leaves the rest to compute
    other = tokens[:4] + [1, 2, 3, 4]
    assert [b.page for b in cache.match(other, 8)] == [7]  # the chain stops at a difference
    assert cache.match([5] + tokens[1:], 10) == []  # a key names the whole prefix
    # Tokens whose KV was not computed yet are never cached.
    assert cache.release(list(range(200, 208)), [3, 4], num_computed=5, borrowed=[]) == [4]


def test_borrowed_blocks_are_not_evicted_and_eviction_is_least_recent_and_deepest_first():
    cache = PrefixCache(PS)
    a, b = list(range(10, 18)), list(range(20, 28))
    cache.release(a, [1, 2], 8, [])
    cache.release(b, [3, 4], 8, [])
    held = cache.match(a, 8)
    cache.borrow(held)
    assert cache.num_evictable == 2
    assert sorted(cache.evict(5)) == [3, 4]  # only b's blocks were free to go
    assert cache.match(b, 8) == []
    # The borrower lets go: its blocks come first in its pages, its own new ones follow.
    free = cache.release(a + [30, 31, 32, 33], [1, 2, 5], 12, borrowed=held)
    assert free == []
    assert [blk.page for blk in cache.match(a + [30, 31, 32, 33, 0], 12)] == [1, 2, 5]
    assert cache.evict(2) == [5, 2]  # a chain goes deepest first: parents outlive children
    with pytest.raises(AssertionError, match="more often than borrowed"):
        cache.give_back(held[1:])


def test_the_same_tokens_cached_twice_keep_one_copy():
    cache = PrefixCache(PS)
    tokens = list(range(8))
    assert cache.release(tokens, [1, 2], 8, []) == []
    assert cache.release(tokens, [3, 4], 8, []) == [3, 4]
    assert cache.num_blocks == 2


# -- the scheduler -----------------------------------------------------------------------------

def cached_core(num_pages: int = 64):
    from service.scheduler_core import SchedulerConfig, SchedulerCore
    core = make_core(num_pages=num_pages, page_size=PS)
    return SchedulerCore(core.info, SchedulerConfig(prefix_cache=True))


def first_plan(core):
    """The next plan (answered with token 7 everywhere, as `run` would) and its extends."""
    plan = core.plan_step()
    sampled = [e.slot for e in plan.extends if e.sample] + unpack_i32(plan.decode_slots).tolist()
    core.process_result(StepResult(
        step_id=plan.step_id, slots=pack_i32(sampled), token_ids=pack_i32([7] * len(sampled)),
        logprobs=b"", top_logprobs_n=0, top_logprob_ids=b"", top_logprobs=b"", forward_ms=1.0))
    return plan, {e.slot: e for e in plan.extends}


def test_a_second_request_prefills_only_what_the_cache_lacks():
    core = cached_core()
    shared = list(range(100, 110))  # two full pages and 2 tokens
    core.add_request("a", shared + [5, 6], SamplingParams(max_new_tokens=3))
    run(core, [7])
    assert core.accounting()["cached_pages"] == 3  # 12 prompt + 2 outputs with KV: 3 pages
    core.add_request("b", shared + [8, 9, 10], SamplingParams(max_new_tokens=2))
    plan, extends = first_plan(core)
    (slot, entry), = extends.items()
    assert entry.prefix_len == 8 and unpack_i32(entry.token_ids).tolist() == [108, 109, 8, 9, 10]
    first_grant = next(g for g in plan.grants if g.slot == slot)
    assert first_grant.first_page_index == 0 and len(unpack_i32(first_grant.pages)) == 2
    assert core.prefix_cache.hit_tokens == 8
    run(core, [7])
    acc = core.accounting()
    assert (acc["free_pages"], acc["free_slots"], acc["running"]) == (
        acc["total_pages"], acc["total_slots"], 0)


def test_a_prompt_wholly_cached_still_computes_its_last_token():
    core = cached_core()
    prompt = list(range(100, 108))  # exactly two pages
    core.add_request("a", prompt, SamplingParams(max_new_tokens=1))
    run(core, [7])
    core.add_request("b", prompt, SamplingParams(max_new_tokens=1))
    _, extends = first_plan(core)
    (entry,) = extends.values()
    assert entry.prefix_len == 4 and len(unpack_i32(entry.token_ids)) == 4


def test_requests_with_penalties_borrow_and_send_the_borrowed_tokens():
    # No prefill chunk carries a borrowed prefix, so the worker learns it from the NewRequest
    # (its penalties must cover it); a request without penalties is not sent it.
    core = cached_core()
    prompt = list(range(100, 110))
    core.add_request("a", prompt, SamplingParams(max_new_tokens=1))
    run(core, [7])
    core.add_request("b", prompt, SamplingParams(max_new_tokens=1, repetition_penalty=1.2))
    plan, extends = first_plan(core)
    assert [e.prefix_len for e in extends.values()] == [8]
    (new,) = plan.new_requests
    assert unpack_i32(new.cached_ids).tolist() == prompt[:8] and new.output_start == 10
    run(core, [7])
    core.add_request("c", prompt, SamplingParams(max_new_tokens=1))
    plan, extends = first_plan(core)
    assert [e.prefix_len for e in extends.values()] == [8]
    assert plan.new_requests[0].cached_ids == b""


def test_cached_pages_make_room_when_wanted_and_nothing_leaks():
    # 16 pages of 4 tokens; 30 requests with distinct 10-token prompts leave far more blocks
    # than fit: eviction must make room every time, and everything ends.
    core = cached_core(num_pages=17)
    for i in range(30):
        core.add_request(f"r{i}", [200 + i] * 10, SamplingParams(max_new_tokens=4))
    outs = [o for o in run(core, [7], max_steps=2000) if o.finished]
    assert len(outs) == 30 and all(o.finish_reason.value == "length" for o in outs)
    acc = core.accounting()
    assert acc["free_pages"] == acc["total_pages"] and 0 < acc["cached_pages"] <= 16


def test_a_dead_worker_empties_the_cache():
    core = cached_core()
    core.add_request("a", list(range(100, 110)), SamplingParams(max_new_tokens=2))
    run(core, [7])
    assert core.accounting()["cached_pages"] > 0
    core.fail_all("the worker died")
    assert core.accounting()["cached_pages"] == 0
    core.add_request("b", list(range(100, 110)), SamplingParams(max_new_tokens=2))
    _, extends = first_plan(core)
    assert [e.prefix_len for e in extends.values()] == [0]


# -- the real model ----------------------------------------------------------------------------

SYSTEM = ("You are a careful assistant for a small shop that sells bicycles, spare parts and "
          "repairs. Answer in one or two sentences, politely, and never invent prices.")
QUESTIONS = ["Do you repair punctures?", "What is a derailleur?", "Can I rent a bike?"]


def chats_with_history(engine) -> list[list[dict]]:
    """A shared system prompt with three questions, then a second turn on the first answer."""
    first = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
             for q in QUESTIONS]
    answer = engine.generate(first[:1], SamplingParams(temperature=0.0, max_new_tokens=24))[0]
    turn2 = first[0] + [{"role": "assistant", "content": answer.text},
                        {"role": "user", "content": "And how long does that take?"}]
    return first + [turn2]


@pytest.fixture(scope="module")
def engines(model_path):
    from fmserve.engine import Engine
    opts = dict(dtype="fp32", page_size=8, max_kv_tokens=4096, max_running_requests=4,
                progress=False)
    return Engine(str(model_path), **opts), Engine(str(model_path), prefix_cache=True, **opts)


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_greedy_tokens_are_the_same_from_cached_prefixes(engines, overlap):
    from tests.engine_runs import assert_accounting_empty

    plain, cached = engines
    plain.overlap = cached.overlap = overlap
    chats = chats_with_history(plain)
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    want = [c.token_ids for c in plain.generate(chats, params)]
    before = cached.scheduler.core.prefix_cache.hit_tokens
    for chat, ids in zip(chats, want):  # one at a time, so each finds the earlier ones cached
        assert cached.generate([chat], params)[0].token_ids == ids
    assert cached.scheduler.core.prefix_cache.hit_tokens - before > 3 * len(SYSTEM) // 8
    assert_accounting_empty(cached)


def test_speculative_decoding_from_cached_prefixes(model_path):
    from fmserve.engine import Engine
    from ipc.spec_settings import SpecSettings
    from tests.engine_runs import assert_accounting_empty

    opts = dict(dtype="fp32", page_size=8, max_kv_tokens=4096, max_running_requests=4,
                progress=False, spec=SpecSettings("eagle3", "", num_steps=3, topk=1,
                                                  num_draft_tokens=4, disable_above_batch_size=0))
    plain, cached = Engine(str(model_path), **opts), Engine(str(model_path), prefix_cache=True,
                                                            **opts)
    chats = chats_with_history(plain)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    want = [c.token_ids for c in plain.generate(chats, params)]
    got = [cached.generate([chat], params)[0].token_ids for chat in chats]
    assert got == want
    assert cached.scheduler.core.prefix_cache.hit_tokens > 0
    assert_accounting_empty(cached)
