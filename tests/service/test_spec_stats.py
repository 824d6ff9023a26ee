"""Speculative decoding statistics: per-request accept lengths and acceptance per draft position
in `Finished` usage and in telemetry, fed to a Scheduler by hand-made step results."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from ipc.client_messages import Finished, Usage
from ipc.codec import decode_service_reply, encode
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from ipc.telemetry import TelemetrySnapshot
from ipc.worker_messages import StepResult, WorkerInfo, pack_i32, unpack_i32
from service.counters import ServiceCounters
from service.replies import usage_of
from service.request import FinishReason
from service.scheduler import Scheduler
from service.scheduler_core import SchedulerConfig
from service.spec_stats import SpecAcceptStats
from service.telemetry import TelemetryPublisher
from tests.service.fake_scheduler import word_tokenizer

NUM_STEPS = 3  # draft depth


def make_core() -> Scheduler:
    info = WorkerInfo(protocol_version=1, model_name="fake", device="cpu", dtype="fp32",
                      attention_backend="torch", num_layers=2, vocab_size=1000,
                      max_context_len=512, page_size=4, num_pages=128, num_slots=5,
                      eos_token_ids=[2], spec_algorithm="eagle3", spec_num_steps=NUM_STEPS,
                      spec_reserve_tokens=2 * (NUM_STEPS + 1))
    return Scheduler(info, word_tokenizer(), SchedulerConfig())


def step(core: Scheduler, accepts: dict[str, int]) -> list:
    """Plan a step and answer it: a request with accept n emits n drafts + a bonus token; -1 is a
    prefill row (one token). Tokens are 100, 101, ... so none is eos."""
    plan = core.plan_step()
    slot_of = {r.rid: r.slot for r in core.core.running.values()}
    rid_of = {s: rid for rid, s in slot_of.items()}
    sampled = [e.slot for e in plan.extends if e.sample] + unpack_i32(plan.decode_slots).tolist()
    assert sorted(rid_of[s] for s in sampled) == sorted(accepts)
    lens = [accepts[rid_of[s]] for s in sampled]
    n_tokens = sum(max(n + 1, 1) for n in lens)
    result = StepResult(step_id=plan.step_id, slots=pack_i32(sampled),
                        token_ids=pack_i32(range(100, 100 + n_tokens)), logprobs=b"",
                        top_logprobs_n=0, top_logprob_ids=b"", top_logprobs=b"", forward_ms=1.0,
                        accept_lens=pack_i32(lens))
    return core.process_result(result)


def snapshot_of(core: Scheduler) -> TelemetrySnapshot:
    spec = SpecSettings(algorithm="eagle3", num_steps=NUM_STEPS, topk=1,
                        num_draft_tokens=NUM_STEPS + 1, disable_above_batch_size=0)
    ctx = zmq.Context()
    try:
        publisher = TelemetryPublisher(ctx, "tcp://127.0.0.1:0", ServiceCounters(started=0.0),
                                       spec, overlap=True, include_text=False)
        snap = publisher.snapshot([core], core.core.info, worker_state="ready", replicas=[])
        publisher.close()
    finally:
        ctx.term()
    # What a monitor reads: the snapshot after a trip over the wire.
    return msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=TelemetrySnapshot)


def test_accept_lengths_reach_usage_and_telemetry():
    core = make_core()
    core.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=50))
    core.add_request("b", [8, 9], SamplingParams(temperature=0.0, max_new_tokens=6))
    step(core, {"a": -1, "b": -1})  # prefill: one token each, no verify step
    snap = snapshot_of(core)
    assert [r.last_accept_len for r in snap.running] == [0, 0]
    assert [r.accept_length for r in snap.running] == [None, None]
    assert snap.spec_accept_length is None and snap.spec_verify_steps == 0
    assert snap.spec_accept_rate_per_position == []
    # The settings come from the config's [spec] section, for the monitor's header.
    assert snap.speculation and snap.spec_config is not None
    assert (snap.spec_config.algorithm, snap.spec_config.num_steps, snap.spec_config.topk,
            snap.spec_config.num_draft_tokens) == ("eagle3", NUM_STEPS, 1, NUM_STEPS + 1)

    step(core, {"a": 2, "b": 0})
    step(core, {"a": 3, "b": 1})
    snap = snapshot_of(core)
    by_id = {r.id: r for r in snap.running}
    assert by_id["a"].last_accept_len == 3 and by_id["b"].last_accept_len == 1
    assert by_id["a"].generated == 1 + 3 + 4 and by_id["b"].generated == 1 + 1 + 2
    assert by_id["a"].accept_length == pytest.approx((2 + 3 + 2) / 2)
    assert by_id["b"].accept_length == pytest.approx((0 + 1 + 2) / 2)
    # Four verify rows accepted 2, 0, 3, 1 drafts: 10 tokens in 4 rows.
    assert snap.spec_verify_steps == 4
    assert snap.spec_accept_length == pytest.approx(10 / 4)
    # Depth 1 accepted by 3 rows (2, 3, 1), depth 2 by 2 (2, 3), depth 3 by 1 (3).
    assert snap.spec_accept_rate_per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])

    # b has 4 of its 6 tokens; accepting 2 drafts emits 3, so it stops at its length limit
    # after 2: its third token, and so its second draft, is never emitted and never counted.
    outs = {o.rid: o for o in step(core, {"a": 0, "b": 2})}
    done = outs["b"]
    assert done.finish_reason == FinishReason.LENGTH and len(done.token_ids) == 2
    assert (done.spec_verify_steps, done.spec_accepted_drafts) == (3, 0 + 1 + 1)
    assert done.spec_accepted_per_position == [2, 0, 0]  # padded to the draft depth
    usage = usage_of(done, arrival=10.0, first_token=10.5, now=12.0)
    assert usage.completion_tokens == 6 and usage.ttft_ms == pytest.approx(500.0)
    # every output token is the prefill's, a verify step's bonus or an accepted draft
    assert usage.completion_tokens == 1 + usage.spec_verify_steps + usage.spec_accepted_drafts
    assert usage.spec_verify_steps == 3 and usage.spec_accepted_drafts == 2
    assert usage.spec_accept_length == pytest.approx((3 + 2) / 3)
    assert usage.spec_accepted_per_position == [2, 0, 0]
    wire = decode_service_reply(encode(Finished("b", done.finish_reason.value, usage)))
    assert wire.usage == usage

    snap = snapshot_of(core)
    assert [r.id for r in snap.running] == ["a"] and snap.running[0].last_accept_len == 0
    assert snap.spec_verify_steps == 6
    assert snap.spec_accept_length == pytest.approx((6 + 2 + 3 + 0 + 1 + 0 + 1) / 6)
    assert snap.spec_accept_rate_per_position == pytest.approx([4 / 6, 2 / 6, 1 / 6])

    aborted = core.abort("a")  # an aborted request reports what it verified too
    assert (aborted.spec_verify_steps, aborted.spec_accepted_drafts) == (3, 5)
    assert aborted.spec_accepted_per_position == [2, 2, 1]
    assert usage_of(aborted, 0.0, None, 1.0).spec_accept_length == pytest.approx(8 / 3)


def test_usage_without_speculation_and_from_an_older_service():
    core = make_core()
    core.add_request("p", [5, 6], SamplingParams(max_new_tokens=1))
    out = step(core, {"p": -1})[0]  # finished after its prefill token: it never verified
    usage = usage_of(out, 0.0, 0.1, 0.2)
    assert (usage.spec_verify_steps, usage.spec_accept_length,
            usage.spec_accepted_per_position) == (0, None, [])
    # A Finished without the speculation fields (an older service) still decodes.
    old = msgspec.msgpack.encode({"type": "finished", "id": "x", "reason": "stop",
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                            "ttft_ms": None, "e2e_ms": 1.0}})
    assert decode_service_reply(old).usage == Usage(3, 1, None, 1.0)


def test_recent_window_follows_new_steps_while_lifetime_rates_remember():
    stats = SpecAcceptStats(num_positions=3, window_steps=8)
    for _ in range(8):
        stats.record_step([3, 3])
    assert stats.recent_accept_length == pytest.approx(4.0)
    stats.record_step([])  # a step with no verify rows (prefill only) changes nothing
    assert stats.recent_accept_length == pytest.approx(4.0)
    for _ in range(8):
        stats.record_step([0])
    assert stats.recent_accept_length == pytest.approx(1.0)  # the window moved on
    assert stats.verify_steps == 24
    assert stats.accept_rate_per_position == pytest.approx([16 / 24] * 3)


def test_engine_counts_acceptance_by_the_tokens_it_emits(model_path):
    # The shipped head through the real engine, with length limits that cut verify steps
    # short: drafts accepted past max_new_tokens used to count, so the accept length of a
    # request exceeded what it emitted.
    from fmserve.engine import Engine

    engine = Engine(model=str(model_path), dtype="fp32", page_size=4, max_kv_tokens=2048,
                    max_running_requests=8, progress=False,
                    spec=SpecSettings("eagle3", "", NUM_STEPS, 1, NUM_STEPS + 1,
                                      disable_above_batch_size=0))
    chats = [[{"role": "user", "content": q}] for q in ("What is 2+2?", "Name three colors.")]
    limits = range(5, 13)
    done = engine.generate([c for c in chats for _ in limits], [
        SamplingParams(temperature=0.0, max_new_tokens=n) for _ in chats for n in limits])
    for c in done:
        per_pos = c.spec_accepted_per_position
        assert c.spec_verify_steps > 0 and len(per_pos) == NUM_STEPS
        assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= c.spec_verify_steps
        assert sum(per_pos) == c.spec_accepted_drafts  # each accepted draft has one depth
        # Every token is the prefill's, or an accepted draft or the bonus of a verify step.
        assert len(c.token_ids) == 1 + c.spec_verify_steps + c.spec_accepted_drafts, c
    stats = engine.scheduler.core.spec_stats
    assert stats.verify_steps == sum(c.spec_verify_steps for c in done)
    assert stats.accepted_drafts == sum(c.spec_accepted_drafts for c in done)
    assert stats.accepted_per_position == [sum(x) for x in zip(
        *(c.spec_accepted_per_position for c in done))]
