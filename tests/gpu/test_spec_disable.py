"""spec.disable_above_batch_size: decode batches above it run without drafting.

Such a step must produce exactly what the plain engine produces (greedy and seeded sampling
alike), and the draft head must keep up (on a CPU it skips those steps and catches up over
them before drafting again: gpu/eagle/head_lag.py), so that once the batch shrinks the
remaining requests speculate as well as they would have from the start.

Every engine here is a CPU worker's, also on a machine with a GPU: the timed gate and the
deferred head are the CPU's (on a GPU the head follows every plain step, in a CUDA graph:
tests/gpu/test_eagle_graphs.py).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from gpu.eagle import head_lag
from gpu.eagle.spec_gate import TRIALS, SizeClass
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from tests.engine_runs import assert_accounting_empty, run_requests
from tests.gpu.spec_runs import QUESTIONS, scenario
from tests.gpu.spec_runs import make_engine as make_any_engine

CHAIN = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                     disable_above_batch_size=0)
TREE = SpecSettings("eagle3", "", num_steps=3, topk=2, num_draft_tokens=6,
                    disable_above_batch_size=0)
LONG_QUESTION = "List the planets of the solar system in order, with one fact about each."


def make_engine(model_path, spec: SpecSettings | None = None, **kw):
    return make_any_engine(model_path, spec, device="cpu", **kw)


def _with_limit(spec: SpecSettings, limit: int | str) -> SpecSettings:
    return SpecSettings(spec.algorithm, spec.draft_model, spec.num_steps, spec.topk,
                        spec.num_draft_tokens, disable_above_batch_size=limit)


@pytest.fixture(scope="module")
def plain(model_path):
    return make_engine(model_path)


@pytest.fixture(scope="module")
def reference(plain):
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [r.visible for r in run_requests(plain, chats, scenario(), overlap=False)]


@pytest.fixture(scope="module")
def limited_chain(model_path):
    """A chain that speculates only for a lone request. Whole prompts prefill in one step, so
    requests submitted together decode together from their first token."""
    return make_engine(model_path, _with_limit(CHAIN, 1), max_tokens_per_step=512)


@pytest.mark.parametrize("spec,overlap", [(CHAIN, True), (TREE, False)], ids=["chain", "tree"])
def test_greedy_identical_as_the_batch_crosses_the_limit(model_path, reference, spec, overlap):
    # 6 requests, 4 running at a time, of 3..23 new tokens: the batch starts above the limit
    # (plain steps) and shrinks below it (verify steps), under both step kinds' bookkeeping.
    engine = make_engine(model_path, _with_limit(spec, 2))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = run_requests(engine, chats, scenario(), overlap)
    assert [r.visible for r in runs] == reference
    verify_steps = sum(r.verify_steps for r in runs)
    assert verify_steps > 0  # the small batches speculated...
    # ...and the big ones did not: beyond each request's first token (from its prefill) and
    # what verify steps emitted (their accepted drafts + a bonus each), tokens came one per
    # plain step. (Tokens past a stop string are dropped, which only lowers the left side.)
    emitted_by_verify = verify_steps + sum(r.accepted_drafts for r in runs)
    assert sum(len(r.token_ids) for r in runs) - len(runs) - emitted_by_verify > 4


def test_auto_switches_by_measured_speed_and_changes_no_token(model_path, reference):
    """Under "auto" the gate tries drafting, then plain steps, per batch size class, and keeps
    what measures faster: the tokens are the plain engine's whichever way each step went."""
    engine = make_engine(model_path, _with_limit(CHAIN, "auto"))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = run_requests(engine, chats, scenario(), overlap=True)
    assert [r.visible for r in runs] == reference
    gate = engine.worker.step.gate
    assert gate.auto and sum(r.verify_steps for r in runs) > 0
    both = [c for c in gate.classes.values() if c.drafting.steps >= TRIALS and c.plain.steps]
    assert both, {k: (c.drafting.steps, c.plain.steps) for k, c in gate.classes.items()}


def test_seeded_sampling_above_the_limit_is_the_plain_engines(plain, limited_chain):
    engine = limited_chain
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_new_tokens=12,
                             ignore_eos=True) for i in range(3)]
    spec_runs = run_requests(engine, chats, params, overlap=True)
    plain_runs = run_requests(plain, chats, params, overlap=True)
    assert [r.token_ids for r in spec_runs] == [r.token_ids for r in plain_runs]
    assert all(r.verify_steps == 0 for r in spec_runs)  # batch 3 > 1 throughout


def _draft_keys_when(engine, chats, params, rid_index: int, at_tokens: int):
    """Run the chats; once request ``rid_index`` has streamed ``at_tokens`` tokens (still
    running), copy its draft-head K cache over the positions it holds. Returns (keys, its
    tokens, its (verify steps, accepted drafts))."""
    engine.overlap = True
    submitted = engine.submit(chats, params)
    rid = submitted[rid_index][0]
    tokens: list[int] = []
    keys = spec = None
    for out in engine.run():
        if out.rid != rid:
            continue
        tokens += out.token_ids
        if out.finished:
            spec = (out.spec_verify_steps, out.spec_accepted_drafts)
        req = engine.scheduler.core.requests.get(rid)
        if keys is None and len(tokens) >= at_tokens and req is not None and not out.finished:
            state = engine.worker.state
            length = int(state.future_map.resolve_seq_lens_host(np.array([req.slot]))[0])
            locs = state.req_to_token.req_to_token[req.slot, :length].long()
            keys = engine.worker.step.drafter.draft_kv.k_buffer[0][locs].float().clone()
    assert_accounting_empty(engine)
    return keys, tokens, spec


@pytest.fixture(scope="module")
def long_alone(model_path):
    """The long request alone under an always-drafting chain: its draft keys after 48 tokens,
    its tokens and its (verify steps, accepted drafts)."""
    return _draft_keys_when(make_engine(model_path, CHAIN),
                            [[{"role": "user", "content": LONG_QUESTION}]],
                            [SamplingParams(temperature=0.0, max_new_tokens=72)], 0, 48)


@pytest.mark.parametrize("max_lag", [64, 5])
def test_the_draft_follows_plain_steps_and_speculates_after(limited_chain, long_alone,
                                                            monkeypatch, max_lag):
    """One long request shares its first steps with three short ones (batch 4 > 1: plain
    steps), then runs alone and speculates. The draft head's KV over its tokens must be what a
    run that speculated all along wrote (each position pairs the target's state there with the
    next token), and its acceptance afterwards as good: whether the head caught up over the
    plain steps only before drafting (64) or also every 5 of them."""
    monkeypatch.setattr(head_lag, "MAX_LAG", max_lag)
    assert limited_chain.worker.step.lag is not None  # a CPU worker defers the head
    long_chat = [{"role": "user", "content": LONG_QUESTION}]
    long_params = SamplingParams(temperature=0.0, max_new_tokens=72)
    alone_keys, alone_tokens, alone_spec = long_alone
    shorts = [[{"role": "user", "content": q}] for q in QUESTIONS[1:4]]
    short_params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * 3
    mixed_keys, mixed_tokens, mixed_spec = _draft_keys_when(
        limited_chain, [long_chat, *shorts], [long_params, *short_params], 0, 48)
    assert mixed_tokens == alone_tokens
    lag = limited_chain.worker.step.lag
    # The catch-ups covered the long request's plain steps: the shorts' 24 tokens are the
    # prefill's first, then 23 steps at batch 4.
    assert lag.tokens >= 23 and lag.seconds > 0
    n = min(len(alone_keys), len(mixed_keys))
    torch.testing.assert_close(mixed_keys[:n], alone_keys[:n], atol=2e-3, rtol=2e-3)

    # At least 24 tokens came one per plain step; the rest through verify steps, accepting
    # drafts at much the rate of the run that speculated all along.
    assert 0 < mixed_spec[0] <= len(mixed_tokens) - 24
    alone_rate, mixed_rate = (a / v for v, a in (alone_spec, mixed_spec))
    assert alone_rate > 0.3, alone_spec  # the shipped head drafts this answer well
    assert mixed_rate > 0.75 * alone_rate, (mixed_spec, alone_spec)


def test_prefills_sharing_a_step_with_plain_decodes_leave_the_draft_whole(
        limited_chain, long_alone, monkeypatch):
    """Four requests at a time with drafting limited to one: as a short request ends, the next
    one's prefill runs in the same target forward as the others' plain decodes
    (EagleStep._prefill with plain decodes). The long request's tokens, and its draft-head KV
    once it runs alone and speculates, are those of a run that speculated all along."""
    from gpu.eagle.eagle_step import EagleStep
    shared = []
    prefill = EagleStep._prefill

    def counting(self, extends, plain_decodes=None):
        shared.append(plain_decodes is not None)
        return prefill(self, extends, plain_decodes)

    monkeypatch.setattr(EagleStep, "_prefill", counting)
    long_chat = [{"role": "user", "content": LONG_QUESTION}]
    long_params = SamplingParams(temperature=0.0, max_new_tokens=72)
    alone_keys, alone_tokens, alone_spec = long_alone
    # The long one with shorts of 8, 20, 20 tokens; then two of 8 join, one at a time.
    shorts = [[{"role": "user", "content": q}] for q in QUESTIONS[1:6]]
    short_params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
                    for n in (8, 20, 20, 8, 8)]
    mixed_keys, mixed_tokens, mixed_spec = _draft_keys_when(
        limited_chain, [long_chat, *shorts], [long_params, *short_params], 0, 48)
    assert sum(shared) >= 2, shared
    assert mixed_tokens == alone_tokens
    n = min(len(alone_keys), len(mixed_keys))
    torch.testing.assert_close(mixed_keys[:n], alone_keys[:n], atol=2e-3, rtol=2e-3)
    alone_rate, mixed_rate = (a / v for v, a in (alone_spec, mixed_spec))
    assert mixed_spec[0] > 0 and mixed_rate > 0.75 * alone_rate, (mixed_spec, alone_spec)


def test_requests_admitted_far_past_break_even_run_without_the_head(model_path, reference,
                                                                    monkeypatch):
    """Under "auto", requests admitted into a batch whose size the gate measured drafting far
    slower at run headless: the tokens are the plain engine's, the head never runs for them
    and they never draft, even once their batch shrinks. A request admitted alone, where
    drafting measured faster, drafts."""
    from gpu.eagle.drafter import Drafter
    engine = make_engine(model_path, _with_limit(CHAIN, "auto"), max_tokens_per_step=512)
    gate = engine.worker.step.gate
    for _ in range(TRIALS):  # per token: 4 requests drafting 5 ms, plain 2.5; alone 3.3 / 10
        gate.record(4, True, 0.040, 8), gate.record(4, False, 0.010, 4)
        gate.record(1, True, 0.010, 3), gate.record(1, False, 0.010, 1)
    assert gate.admits_headless(4) and not gate.admits_headless(1)
    head_runs = []
    forward = Drafter.forward
    monkeypatch.setattr(Drafter, "forward",
                        lambda self, *a: head_runs.append(1) or forward(self, *a))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    runs = run_requests(engine, chats, scenario()[:4], overlap=True)
    assert [r.visible for r in runs] == reference[:4]
    assert head_runs == [] and all(r.verify_steps == 0 for r in runs)
    assert engine.worker.step.lag.behind == {}  # nothing kept for them either
    alone = run_requests(engine, [[{"role": "user", "content": LONG_QUESTION}]],
                         [SamplingParams(temperature=0.0, max_new_tokens=24)], overlap=True)
    assert head_runs and alone[0].verify_steps > 0


def test_a_request_admitted_with_the_head_drops_it_when_its_batch_grows_past_break_even(
        model_path, plain, monkeypatch):
    """A request admitted alone keeps the head and drafts; once three more join and the batch
    is where drafting measured far slower, it goes on headless like them: the head runs no
    more, nothing is kept for it, and its tokens are the plain engine's."""
    from gpu.eagle.drafter import Drafter
    engine = make_engine(model_path, _with_limit(CHAIN, "auto"), max_tokens_per_step=512)
    gate, lag = engine.worker.step.gate, engine.worker.step.lag
    for _ in range(TRIALS):  # per token: 4 requests drafting 5 ms, plain 2.5; alone 3.3 / 10
        gate.record(4, True, 0.040, 8), gate.record(4, False, 0.010, 4)
        gate.record(1, True, 0.010, 3), gate.record(1, False, 0.010, 1)
    head_runs = []
    forward = Drafter.forward
    monkeypatch.setattr(Drafter, "forward",
                        lambda self, *a: head_runs.append(1) or forward(self, *a))
    long_chat = [{"role": "user", "content": LONG_QUESTION}]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    engine.overlap = False
    (rid, _), = engine.submit([long_chat], params)
    tokens, shorts, runs_when_joined = [], None, None
    for out in engine.run():
        if out.rid == rid:
            tokens += out.token_ids
        if shorts is None and len(tokens) >= 8:
            assert head_runs and lag.running - lag.headless  # alone: the head, drafting
            shorts = engine.submit([[{"role": "user", "content": q}] for q in QUESTIONS[1:4]],
                                   SamplingParams(temperature=0.0, max_new_tokens=12,
                                                  ignore_eos=True))
        elif shorts is not None and runs_when_joined is None and out.rid != rid:
            runs_when_joined = len(head_runs)  # the shorts' first tokens: batch 4 now
            assert lag.headless == lag.running and lag.behind == {}
    assert runs_when_joined is not None and len(head_runs) == runs_when_joined
    assert tokens == plain.generate([long_chat], params)[0].token_ids
    assert_accounting_empty(engine)


def test_auto_keeps_its_measurements_for_the_next_worker(model_path, tmp_path, monkeypatch):
    """A worker's gate saves the classes it measured both ways (gpu/eagle/gate_memory.py), and
    the next worker with the same model, head and settings starts from them; another head
    shape measures afresh."""
    monkeypatch.setenv("FMSERVE_GATE_CACHE", str(tmp_path / "spec_gate.json"))
    first = make_engine(model_path, _with_limit(CHAIN, "auto"), max_tokens_per_step=512)
    run_requests(first, [[{"role": "user", "content": LONG_QUESTION}]],
                 [SamplingParams(temperature=0.0, max_new_tokens=24)], overlap=True)
    decided = first.worker.step.gate.decided()
    assert 1 in decided and (tmp_path / "spec_gate.json").exists()
    # Saved whenever a class's verdict appears or changes (and every SAVE_EVERY steps), so the
    # file may trail the last few measurements: the next worker starts from the file.
    saved = msgspec.json.decode((tmp_path / "spec_gate.json").read_bytes(),
                                type=dict[str, dict[int, SizeClass]])
    (kept,) = saved.values()
    assert sorted(kept) == sorted(decided)
    second = make_engine(model_path, _with_limit(CHAIN, "auto"), max_tokens_per_step=512)
    restored = second.worker.step.gate.classes
    assert sorted(restored) == sorted(decided)
    assert restored[1].drafting.seconds_per_token == pytest.approx(
        kept[1].drafting.seconds_per_token)
    assert restored[1].drafting.seconds_per_token > 0
    shallower = SpecSettings("eagle3", "", num_steps=2, topk=1, num_draft_tokens=3,
                             disable_above_batch_size="auto")
    assert make_engine(model_path, shallower).worker.step.gate.classes == {}


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="disable_above_batch_size must be >= 0"):
        _with_limit(CHAIN, -1).validate()
