"""spec.disable_above_batch_size = "auto" on one GPU (gpu/eagle/head_lag.py, regime "drop"):
a fixed limit of GPU_AUTO_LIMIT requests, above which requests run headless and their steps run
as the plain step (gpu/eagle/headless_steps.py), so the head costs nothing where speculation is
off. A request alone drafts; one admitted with the head drops it when its batch grows past the
limit; a request joining a headless one is headless too; the tokens are the plain engine's, and
no launch waits for the device (a deferred head would read positions on the host).

On a CPU the regime is the timed one, so these tests take the GPU's on the CPU (its decode in C
where the GPU replays CUDA graphs); on a GPU they run it as it is.
"""

from __future__ import annotations

import pytest
import torch

from gpu.eagle import eagle_step
from gpu.eagle.drafter import Drafter
from gpu.eagle.headless_steps import HeadlessSteps
from gpu.eagle.spec_gate import GPU_AUTO_LIMIT
from gpu.sync_guard import no_host_sync
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from tests.engine_runs import assert_accounting_empty, run_requests
from tests.gpu.spec_runs import QUESTIONS, make_engine, scenario

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AUTO = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                    disable_above_batch_size="auto")
LONG_CHAT = [{"role": "user", "content": "List the planets of the solar system in order, "
                                         "with one fact about each."}]


@pytest.fixture
def gpu_regime(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(eagle_step, "head_regime", lambda state, limit: "drop")


@pytest.fixture
def counted(monkeypatch):
    """{"head": the draft head's forwards, "plain": steps run as the plain step}."""
    counts = {"head": 0, "plain": 0}
    forward, launch = Drafter.forward, HeadlessSteps.launch

    def head(self, *args):
        counts["head"] += 1
        return forward(self, *args)

    def plain(self, *args):
        counts["plain"] += 1
        return launch(self, *args)

    monkeypatch.setattr(Drafter, "forward", head)
    monkeypatch.setattr(HeadlessSteps, "launch", plain)
    return counts


@pytest.fixture(scope="module")
def plain_engine(model_path):
    return make_engine(model_path, device=DEVICE)


def test_batches_above_the_limit_never_run_the_head_and_give_the_plain_tokens(
        model_path, plain_engine, gpu_regime, counted):
    engine = make_engine(model_path, AUTO, device=DEVICE, max_tokens_per_step=512,
                         max_running_requests=3)
    step = engine.worker.step
    assert (step.gate.limit, step.gate.drops_heads, step.gate.auto) == (GPU_AUTO_LIMIT, True,
                                                                        False)
    assert step.headless is not None
    assert f"batches above {GPU_AUTO_LIMIT} requests headless as the plain step" in (
        engine.worker.fast_paths())  # the worker's ready line says so
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    params = scenario()[:4]
    reference = [r.visible for r in run_requests(plain_engine, chats, params, False)]
    prepared, prepare = [], engine.worker.prepare
    engine.worker.prepare = lambda plan: prepared.append(prepare(plan)) or prepared[-1]
    # 4 requests, 3 admitted at once (above the limit; whole prompts prefill in one step), the
    # last beside headless ones; with overlap, as a GPU serves (step k + 1 launched first).
    runs = run_requests(engine, chats, params, overlap=True)
    assert [r.visible for r in runs] == reference
    assert counted["head"] == 0 and counted["plain"] > 0
    assert all(r.verify_steps == 0 for r in runs)
    # Each such step's plain batch was built in prepare (under launch_ahead "prepare" a GPU
    # builds it while the step before runs), as the plain step builds its own.
    assert sum(p.batch is not None for p in prepared) == counted["plain"]
    # A request alone afterwards is admitted with the head and drafts.
    lone = SamplingParams(temperature=0.0, max_new_tokens=16)
    alone = run_requests(engine, [LONG_CHAT], [lone], True)
    assert alone[0].verify_steps > 0 and counted["head"] > 0
    assert alone[0].token_ids == plain_engine.generate([LONG_CHAT], lone)[0].token_ids
    assert step.lag.behind == {}  # nothing was ever deferred
    assert_accounting_empty(engine)


def test_a_request_with_the_head_drops_it_when_its_batch_grows_past_the_limit(
        model_path, plain_engine, gpu_regime, counted):
    engine = make_engine(model_path, AUTO, device=DEVICE, max_tokens_per_step=512)
    lag = engine.worker.step.lag
    params = SamplingParams(temperature=0.0, max_new_tokens=28, ignore_eos=True)
    engine.overlap = False
    (rid, _), = engine.submit([LONG_CHAT], params)
    tokens, shorts, heads_when_joined = [], None, None
    for out in engine.run():
        if out.rid == rid:
            tokens += out.token_ids
        if shorts is None and len(tokens) >= 8:
            assert counted["head"] and lag.running - lag.headless  # alone: drafting
            shorts = engine.submit([[{"role": "user", "content": q}] for q in QUESTIONS[1:4]],
                                   SamplingParams(temperature=0.0, max_new_tokens=8,
                                                  ignore_eos=True))
        elif shorts is not None and heads_when_joined is None and out.rid != rid:
            heads_when_joined = counted["head"]  # the shorts' first tokens: batch 4 now
            assert lag.headless == lag.running and lag.behind == {}
    assert heads_when_joined is not None and counted["head"] == heads_when_joined
    assert counted["plain"] > 0
    assert tokens == plain_engine.generate([LONG_CHAT], params)[0].token_ids
    assert_accounting_empty(engine)


def test_no_launch_waits_for_the_device(model_path, gpu_regime):
    """Greedy and sampled requests crossing the limit both ways (a lone one drafting, then a
    batch above the limit, admitted a few at a time, then its tail below it), with overlap:
    every launch free of host syncs."""
    engine = make_engine(model_path, AUTO, device=DEVICE)
    engine.worker.state.future_map.wrwr_check = False  # the debug check reads on purpose
    worker, launches = engine.worker, [0]
    launch = worker.launch

    def guarded(plan):
        with no_host_sync(worker.state.device):
            launches[0] += 1
            return launch(plan)

    worker.launch = guarded
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = [SamplingParams(temperature=0.0, max_new_tokens=10),
              SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=6),
              *scenario()[2:]]
    run_requests(engine, [LONG_CHAT], [SamplingParams(temperature=0.0, max_new_tokens=8)], True)
    run_requests(engine, chats, params, True)
    assert launches[0] > 10
    assert_accounting_empty(engine)


def test_a_request_joining_a_headless_one_runs_headless_too(model_path, plain_engine,
                                                           gpu_regime, counted):
    """A long request admitted with two short ones (above the limit) goes on headless alone;
    one that joins it then (a batch of 2, within the limit) is headless too, so no step holds
    a request whose head would have to follow or wait: the head never runs, nothing waits
    for the device, and both get the plain engine's tokens."""
    engine = make_engine(model_path, AUTO, device=DEVICE, max_tokens_per_step=512)
    engine.overlap = False
    worker, launch = engine.worker, engine.worker.launch

    def guarded(plan):
        with no_host_sync(worker.state.device):
            return launch(plan)

    worker.launch = guarded
    long_params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    submitted = engine.submit([LONG_CHAT, *[[{"role": "user", "content": q}]
                                            for q in QUESTIONS[1:3]]], [long_params, short, short])
    rid, shorts = submitted[0][0], {r for r, _ in submitted[1:]}
    tokens, joined, late = [], None, []
    for out in engine.run():
        if out.rid == rid:
            tokens += out.token_ids
        if out.finished and out.rid in shorts:
            shorts.discard(out.rid)
            if not shorts:  # the long one alone now, headless
                joined = engine.submit([[{"role": "user", "content": QUESTIONS[4]}]],
                                       short)[0][0]
        if out.rid == joined:
            late += out.token_ids
    assert joined is not None and counted["head"] == 0 and counted["plain"] > 0
    assert tokens == plain_engine.generate([LONG_CHAT], long_params)[0].token_ids
    assert late == plain_engine.generate([[{"role": "user", "content": QUESTIONS[4]}]],
                                         short)[0].token_ids
    assert_accounting_empty(engine)
