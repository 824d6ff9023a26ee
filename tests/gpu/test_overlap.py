"""Overlap scheduling (plan k+1 before result k) changes nothing a client can see."""

from __future__ import annotations

import pytest

from fmserve.engine import Engine
from ipc.sampling import SamplingParams
from ipc.worker_messages import StepPlan, pack_i32
from gpu.future_map import FutureMapInvariantError
from tests.engine_runs import run_requests

QUESTIONS = ["What is 2+2?", "Name three colors.", "Write a haiku about rain.",
             "Explain gravity to a child.", "Say hi.", "List the planets in order.",
             "What is the capital of Italy?", "Give me a word that rhymes with cat."]


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine(model=str(model_path), dtype="fp32", page_size=4, max_kv_tokens=2048,
                  max_running_requests=6, max_tokens_per_step=64, progress=False)


def scenario(engine: Engine) -> list[SamplingParams]:
    params = []
    for i, _ in enumerate(QUESTIONS):
        stop = [" the"] if i % 3 == 0 else []
        params.append(SamplingParams(temperature=0.0, max_new_tokens=4 + 3 * i, stop=stop))
    return params


def run(engine: Engine, overlap: bool, abort_after: int | None = None) -> list[tuple]:
    """(tokens, text, finish reason) per question; with abort_after, question 3 is aborted
    after that many tokens."""
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    runs = run_requests(engine, chats, scenario(engine), overlap,
                        abort_index=3 if abort_after else None, abort_after=abort_after or 0)
    return [r.visible for r in runs]


def test_greedy_outputs_identical_with_and_without_overlap(engine):
    off = run(engine, overlap=False)
    stale_before = engine.scheduler.core.num_stale_results
    on = run(engine, overlap=True)
    assert on == off
    reasons = {r[2] for r in off}
    assert {"stop", "length"} <= reasons, reasons  # the scenario mixes stop kinds
    # Requests finished in step k while already planned into step k+1: dropped, once each.
    assert engine.scheduler.core.num_stale_results > stale_before


def test_abort_mid_stream_with_overlap(engine):
    off = run(engine, overlap=False, abort_after=3)
    on = run(engine, overlap=True, abort_after=3)
    assert off[3][2] == on[3][2] == "abort"
    assert off[3][0] == on[3][0] and len(on[3][0]) == 3
    assert on[:3] + on[4:] == off[:3] + off[4:]


def test_retraction_under_overlap_keeps_outputs(model_path, engine):
    reference = run(engine, overlap=False)
    tight = Engine(model=str(model_path), dtype="fp32", page_size=4, max_kv_tokens=4 * 30,
                   max_running_requests=6, max_tokens_per_step=64, progress=False)
    assert run(tight, overlap=True) == reference
    assert tight.scheduler.core.num_retractions > 0, "the test no longer exercises retraction"


def test_decode_before_any_write_trips_the_invariant(engine):
    state = engine.worker.state
    if state.device.type != "cpu":
        pytest.skip("on a GPU the check is a device-side assert, which ends the process: "
                    "tests/gpu/test_cuda.py checks it there in a subprocess")
    assert state.future_map.wrwr_check, "the suite runs with FMSERVE_WRWR_CHECK=1"
    # Slot 5 is released (its last token forgotten) and then decoded without a prefill.
    plan = StepPlan(step_id=10_000, new_requests=[], grants=[], extends=[],
                    decode_slots=pack_i32([5]), released_slots=pack_i32([5]))
    with pytest.raises(FutureMapInvariantError):
        engine.worker.run_step(plan)
