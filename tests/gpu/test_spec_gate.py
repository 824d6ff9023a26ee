"""gpu/eagle/spec_gate.py: which decode batches draft, by a fixed limit or by measured speed."""

from types import SimpleNamespace

import msgspec
import pytest
import torch

from gpu.eagle import gate_memory
from gpu.eagle.gate_memory import GateMemory
from gpu.eagle.spec_gate import (FAR_BEHIND, GPU_AUTO_LIMIT, HEADLESS_BACKOFF, HEADLESS_REPROBE,
                                 REPROBE_EVERY, RESTORED_STEPS, SETTLED_STEPS, TRIALS, SizeClass,
                                 SpecGate, size_class)
from ipc.worker_config import ModelSettings, WorkerConfig


def test_size_classes_are_powers_of_two():
    assert [size_class(b) for b in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


@pytest.mark.parametrize("limit, drafting", [(0, [1, 2, 3, 64]), (2, [1, 2]), (1, [1])])
def test_a_fixed_limit_drafts_up_to_it(limit, drafting):
    gate = SpecGate(limit, measured=True)
    assert [b for b in (1, 2, 3, 64) if gate.drafts(b)] == drafting


def test_auto_without_a_host_clock_that_measures_always_drafts():
    gate = SpecGate("auto", measured=False)  # deterministic mode, tensor-parallel ranks
    assert all(gate.drafts(b) for b in (1, 8, 256))


def test_auto_on_a_gpu_is_the_measured_fixed_limit():
    gate = SpecGate("auto", measured=False, unmeasured_auto=GPU_AUTO_LIMIT)
    assert [b for b in range(1, 9) if gate.drafts(b)] == list(range(1, GPU_AUTO_LIMIT + 1))
    gate.record(1, True, 1.0, 1)  # nothing is timed there: the limit stays
    assert not gate.drafts(8)
    assert SpecGate(4, measured=False, unmeasured_auto=GPU_AUTO_LIMIT).drafts(4)  # as set


def run(gate: SpecGate, batch: int, steps: int, draft_s: float, plain_s: float) -> list[bool]:
    """`steps` decode steps of `batch` requests: drafting emits 2 tokens a request in
    `draft_s`, plain decoding 1 a request in `plain_s`. Returns which drafted."""
    chosen = []
    for _ in range(steps):
        drafted = gate.drafts(batch)
        chosen.append(drafted)
        gate.record(batch, drafted, draft_s if drafted else plain_s, batch * (2 if drafted else 1))
    return chosen


def test_auto_drafts_where_drafting_is_faster_per_token_and_not_elsewhere():
    gate = SpecGate("auto", measured=True)
    # batch 1: a verify of 2 tokens costs 1.2x a decode -> 0.6 a token against 1.0
    small = run(gate, 1, 2 * TRIALS + REPROBE_EVERY - 1, draft_s=1.2, plain_s=1.0)
    # batch 8: a verify costs 3x a decode -> 1.5 a token against 1.0
    large = run(gate, 8, 2 * TRIALS + REPROBE_EVERY - 1, draft_s=3.0, plain_s=1.0)
    assert small[:TRIALS] == [True] * TRIALS and small[TRIALS:2 * TRIALS] == [False] * TRIALS
    assert all(small[2 * TRIALS:]) and not any(large[2 * TRIALS:])
    assert gate.drafts(5) is False  # 5-8 is one class: measured once for all of it
    assert gate.drafts(2) is True  # a class not measured yet tries drafting first
    # ... unless a smaller class measured drafting far behind: a larger one is not tried
    assert gate.admits_headless(8) and gate.admits_headless(32)
    assert not gate.admits_headless(1) and not gate.admits_headless(4)
    assert run(gate, 32, 2 * TRIALS, draft_s=1.0, plain_s=1.0) == [False] * (2 * TRIALS)


def test_auto_measures_the_losing_way_again_and_follows_a_change():
    gate = SpecGate("auto", measured=True)
    run(gate, 4, 2 * TRIALS, draft_s=3.0, plain_s=1.0)  # plain wins, drafting 1.5x behind
    far = REPROBE_EVERY * FAR_BEHIND + 1
    assert sum(run(gate, 4, 3 * far, draft_s=3.0, plain_s=1.0)) == 3  # a probe every `far`
    # Drafting becomes far cheaper (longer contexts, better acceptance): the periodic probes
    # of drafting see it, and the class turns to drafting; plain, far behind now, is probed
    # every `far` steps in turn.
    chosen = run(gate, 4, 8 * far, draft_s=0.5, plain_s=1.0)
    assert chosen.index(True) < far and chosen[-far:].count(False) == 1


def test_a_close_call_is_measured_again_sooner():
    gate = SpecGate("auto", measured=True)
    run(gate, 1, 2 * TRIALS, draft_s=2.0, plain_s=0.9)  # 1.0 a token against 0.9: close
    chosen = run(gate, 1, 3 * (REPROBE_EVERY + 1), draft_s=2.0, plain_s=0.9)
    assert sum(chosen) == 3  # plain, but for a probe of drafting every REPROBE_EVERY + 1


def test_the_heads_catch_up_counts_against_the_plain_way():
    """Plain steps defer the head's work to a catch-up (gpu/eagle/head_lag.py). Drafting at
    2.2 s for 2 tokens loses to plain at 1.0 s a token alone, and wins once each plain token
    also costs 0.2 s of catch-up; a catch-up is never charged to drafting."""
    alone = SpecGate("auto", measured=True)
    assert run(alone, 1, TRIALS * 2 + 6, 2.2, 1.0)[-6:] == [False] * 6
    charged = SpecGate("auto", measured=True)
    charged.record_catch_up(1, 2.0, 10)
    assert charged.classes[1].catch_up_per_token == pytest.approx(0.2)
    assert run(charged, 1, TRIALS * 2 + 6, 2.2, 1.0)[-6:] == [True] * 6
    # Per batch size class: one stream's catch-ups say nothing of a batch of 8's
    assert run(charged, 8, TRIALS * 2 + 6, 2.2 * 8, 1.0 * 8)[-6:] == [False] * 6
    fixed = SpecGate(0, measured=True)
    fixed.record_catch_up(1, 2.0, 10)
    assert fixed.classes == {}


def test_a_probe_that_falls_due_among_headless_requests_waits_and_readmits_the_head():
    """While a batch holds a headless request it cannot draft: its steps count toward the
    probe, and once the probe is due new requests are admitted with the head again, and the
    first batch that can draft runs it."""
    gate = SpecGate("auto", measured=True)
    run(gate, 4, 2 * TRIALS, draft_s=3.0, plain_s=1.0)  # drafting 1.5 a token against 1.0
    assert gate.admits_headless(4)
    headless = [gate.drafts(4, can_draft=False) for _ in range(HEADLESS_REPROBE - 1)]
    assert not any(headless) and gate.admits_headless(4)
    gate.drafts(4, can_draft=False)
    assert not gate.admits_headless(4)  # the probe is due: admit with the head
    assert gate.drafts(4) is True  # the first batch that can draft probes
    assert gate.admits_headless(4) and gate.drafts(4) is False


def test_each_probe_that_finds_drafting_still_losing_doubles_the_wait_for_the_next():
    """A probe's requests carry the head until a batch of them drafts: where drafting keeps
    losing, each probe waits twice as long as the one before, up to 2 ** HEADLESS_BACKOFF
    times HEADLESS_REPROBE; once drafting catches up, the wait starts from the least again."""
    gate = SpecGate("auto", measured=True)
    run(gate, 4, 2 * TRIALS, draft_s=3.0, plain_s=1.0)  # drafting 1.5 a token against 1.0
    waits = []
    for _ in range(HEADLESS_BACKOFF + 2):
        steps = 0
        while gate.admits_headless(4):
            gate.drafts(4, can_draft=False)
            steps += 1
        waits.append(steps)
        assert gate.drafts(4) is True  # the probe, and it loses again
        gate.record(4, True, 3.0, 8)
    assert waits == [HEADLESS_REPROBE << min(i, HEADLESS_BACKOFF)
                     for i in range(HEADLESS_BACKOFF + 2)]
    c = gate.classes[4]
    c.drafting.seconds, c.drafting.tokens = 0.5, 8.0  # drafting now 0.06 a token: it pays
    assert not gate.admits_headless(4) and c.lost_probes == 0


def test_one_or_two_streams_are_admitted_headless_only_once_both_ways_settle():
    """A trial at one stream rides on one request's acceptance: drafting measured slower there
    keeps the head (the gate goes on probing) and says nothing of larger batches, until both
    ways have SETTLED_STEPS steps, over this run and the kept ones; then a class where drafting
    does not pay runs headless, as do the larger ones, and where it pays keeps the head."""
    gate = SpecGate("auto", measured=True)
    run(gate, 1, 2 * TRIALS, draft_s=3.0, plain_s=1.0)
    run(gate, 2, 2 * TRIALS, draft_s=3.0, plain_s=1.0)
    assert not any(gate.admits_headless(n) for n in (1, 2, 3, 4))
    assert gate.drafts(4) is True  # class 3-4 is still tried
    c = gate.classes[1]
    while min(c.drafting.seen, c.plain.seen) < SETTLED_STEPS - 1:  # the probes go on
        run(gate, 1, 1, draft_s=3.0, plain_s=1.0)
    assert not gate.admits_headless(1)
    run(gate, 1, REPROBE_EVERY * FAR_BEHIND + 1, draft_s=3.0, plain_s=1.0)  # one more probe
    # settled: one stream runs headless, and larger batches, where drafting only costs more
    assert all(gate.admits_headless(n) for n in (1, 2, 4, 8))
    # settled where drafting pays (0.6 a token against 1.0): the head stays
    paying = SpecGate("auto", measured=True)
    run(paying, 1, 2 * TRIALS + SETTLED_STEPS * REPROBE_EVERY * FAR_BEHIND, draft_s=1.2,
        plain_s=1.0)  # plain, far behind, is probed every REPROBE_EVERY * FAR_BEHIND steps
    assert min(paying.classes[1].drafting.seen, paying.classes[1].plain.seen) >= SETTLED_STEPS
    assert not paying.admits_headless(1)
    # what counts is the steps seen over the runs, kept with the class (gate_memory.py)
    kept = msgspec.json.decode(msgspec.json.encode(gate.decided()), type=dict[int, SizeClass])
    restored = SpecGate("auto", measured=True)
    restored.restore(kept)
    assert restored.classes[1].drafting.steps <= RESTORED_STEPS and restored.admits_headless(1)


def test_a_ways_first_step_in_a_class_is_not_measured():
    """The first drafting step of a process runs cold (first calls, new shapes: 15 against ~6
    ms a token served at one stream): counting it kept one stream plain for ~400 steps."""
    gate = SpecGate("auto", measured=True)
    gate.record(1, True, 10.0, 2)  # cold
    for _ in range(TRIALS - 1):
        gate.record(1, True, 1.2, 2)  # 0.6 a token
    for _ in range(TRIALS):
        gate.record(1, False, 1.0, 1)
    assert gate.drafts(1) is True
    assert gate.classes[1].drafting.seconds_per_token == pytest.approx(0.6)


def learned() -> SpecGate:
    """Drafting pays at one stream (0.6 a token against 1.0) and loses at 8 (1.5 against 1.0)."""
    gate = SpecGate("auto", measured=True)
    run(gate, 1, 2 * TRIALS, draft_s=1.2, plain_s=1.0)
    run(gate, 8, 2 * TRIALS + RESTORED_STEPS, draft_s=3.0, plain_s=1.0)
    run(gate, 2, 1, draft_s=1.0, plain_s=1.0)  # class 2 tried once: not decided, not kept
    return gate


def test_a_restored_gate_starts_from_the_kept_verdicts():
    kept = msgspec.json.decode(msgspec.json.encode(learned().decided()), type=dict[int, SizeClass])
    assert sorted(kept) == [1, 8]
    gate = SpecGate("auto", measured=True)
    gate.restore(kept)
    # The kept means weigh as RESTORED_STEPS steps at most; this process's first step is not
    # measured.
    way = gate.classes[8].plain
    before = way.seconds_per_token
    assert way.steps == RESTORED_STEPS
    way.add(10.0, 8)  # not measured: cold here
    assert way.seconds_per_token == pytest.approx(before)
    way.add(0.8 * 8, 8)  # 0.8 a token, weighted 1 / (RESTORED_STEPS + 1)
    assert way.seconds_per_token == pytest.approx(before + (0.8 - before) / (RESTORED_STEPS + 1),
                                                  rel=0.05)
    # No trials: one stream drafts, 8 streams are admitted headless and larger ones not tried.
    assert run(gate, 1, 2, draft_s=1.2, plain_s=1.0) == [True, True]
    assert gate.admits_headless(8) and gate.admits_headless(32) and not gate.drafts(32)


def test_the_gate_memory_keeps_decided_classes_per_key_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "spec_gate.json"
    gate = learned()
    memory = GateMemory(path, "run-a")
    memory.after_step(gate)  # new verdicts: saved at once
    other = GateMemory(path, "run-b")  # another model, head or machine shares the file
    other.after_step(learned())
    restored = SpecGate("auto", measured=True)
    GateMemory(path, "run-a").restore(restored)
    assert sorted(restored.classes) == [1, 8] and restored.admits_headless(8)
    fresh = SpecGate("auto", measured=True)
    GateMemory(path, "run-c").restore(fresh)
    assert fresh.classes == {}
    path.write_text("{not json")
    GateMemory(path, "run-a").restore(fresh)  # ignored with a warning, measured afresh
    assert fresh.classes == {}
    memory.after_step(gate)  # unchanged verdicts: not saved again before SAVE_EVERY steps
    assert path.read_text() == "{not json"
    memory.verdicts = {}
    memory.after_step(gate)
    assert sorted(msgspec.json.decode(path.read_bytes())) == ["run-a"]


def test_the_run_key_changes_with_the_c_kernels_sources(monkeypatch, model_path):
    """Verdicts measured with another build of the C kernels are not read: a faster plain
    step moves the break-even."""
    state = SimpleNamespace(cfg=WorkerConfig(model=ModelSettings(path=str(model_path))),
                            device=torch.device("cpu"), dtype=torch.float32)
    first = gate_memory._run_key(state)
    assert gate_memory._run_key(state) == first  # the same build, the same key
    monkeypatch.setattr(gate_memory, "build_key", lambda: "another-build")
    assert gate_memory._run_key(state) != first
