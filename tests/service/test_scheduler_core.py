"""SchedulerCore limits on its own, fed hand-made step results (no worker, no model)."""

from __future__ import annotations

from ipc.sampling import SamplingParams
from ipc.worker_messages import StepResult, pack_f32, pack_i32, unpack_i32
from service.request import FinishReason
from service.scheduler import Scheduler
from tests.service.fake_scheduler import make_core, make_scheduler, run


def test_request_outgrowing_the_kv_cache_ends_with_length_and_never_blocks_the_queue():
    # 8 pages of 4 tokens. The long request used to grow until it had to retract itself, and
    # then waited for room (its length + a page of headroom) that the cache never has: it never
    # ended, and the request queued behind it never started.
    core = make_core(num_pages=9)
    core.add_request("long", [5] * 10, SamplingParams(max_new_tokens=100, ignore_eos=True))
    core.add_request("next", [6] * 3, SamplingParams(max_new_tokens=2))
    ends = {o.rid: o for o in run(core, [100]) if o.finished}
    assert ends["long"].finish_reason == FinishReason.LENGTH
    assert ends["long"].prompt_tokens + ends["long"].completion_tokens == core.max_seq_len == 28
    assert ends["next"].completion_tokens == 2
    acc = core.accounting()
    assert (acc["free_pages"], acc["free_slots"], acc["running"], acc["waiting"]) == (
        acc["total_pages"], acc["total_slots"], 0, 0)


def test_stop_string_before_min_new_tokens_is_streamed_not_dropped():
    # A stop string completed before min_new_tokens ends nothing; its text used to vanish from
    # the stream while its token was still sent.
    core = make_scheduler()
    core.add_request("r", [5, 6], SamplingParams(max_new_tokens=10, min_new_tokens=3,
                                                 stop=["<101>"]))
    outs = [o for o in run(core, [100, 101, 102, 101, 103])]
    assert "".join(o.text for o in outs) == "<100><101><102>"
    assert [t for o in outs for t in o.token_ids] == [100, 101, 102, 101]
    assert outs[-1].finish_reason == FinishReason.STOP


def test_params_refused_against_the_vocabulary_never_quote_the_internal_key():
    # top_k and stop_token_ids are checked against the model's vocabulary here, at admission
    # (the codec does not know it). In the service the id is "<identity hex>/<client id>": the
    # message must not show it (the Error carries the client's own id).
    import pytest

    from service.scheduler_core import RequestRejected

    core = make_core()
    vocab = core.info.vocab_size
    for params in (SamplingParams(top_k=vocab + 1), SamplingParams(stop_token_ids=[vocab])):
        with pytest.raises(RequestRejected) as info:
            core.add_request("c0ffee/r-7", [1, 2, 3], params)
        assert info.value.code == "invalid_params"
        assert str(info.value).startswith("sampling parameter")
        assert "c0ffee" not in str(info.value)
    assert core.accounting()["waiting"] == 0


def answer(core: Scheduler, rows: dict[str, list[int]], logprobs: bool = False) -> list:
    """Answer the next plan as a speculative step would: each request's row emits its tokens
    (accept_len + 1 of them; a prefill row one, its accept_len -1)."""
    plan = core.plan_step()
    slot_rid = {r.slot: r.rid for r in core.core.running.values()}
    prefills = [e.slot for e in plan.extends if e.sample]
    sampled = prefills + unpack_i32(plan.decode_slots).tolist()
    tokens = [t for s in sampled for t in rows[slot_rid[s]]]
    return core.process_result(StepResult(
        step_id=plan.step_id, slots=pack_i32(sampled), token_ids=pack_i32(tokens),
        logprobs=pack_f32([-0.5 - i for i in range(len(tokens))]) if logprobs else b"",
        top_logprobs_n=0, top_logprob_ids=b"", top_logprobs=b"", forward_ms=1.0,
        accept_lens=pack_i32([-1 if s in prefills else len(rows[slot_rid[s]]) - 1
                              for s in sampled])))


def test_a_stop_string_inside_a_verify_row_ends_the_request_there_and_frees_it():
    # The core ends requests on tokens; the text finds the stop string at the row's second token
    # and the core drops the rest (an eos among them included), counting only what was kept.
    for tail in ([103, 104], [2, 104], [103, 2]):
        core = make_scheduler()
        core.add_request("r", [5, 6], SamplingParams(max_new_tokens=20, stop=["<101><102>"],
                                                     logprobs=0))
        assert [o.token_ids for o in answer(core, {"r": [100]})] == [[100]]  # the prefill
        (out,) = answer(core, {"r": [101, 102, *tail]}, logprobs=True)
        assert out.finish_reason == FinishReason.STOP
        assert out.token_ids == [101, 102] and out.text == "" and out.completion_tokens == 3
        assert [lp.logprob for lp in out.logprobs] == [-0.5, -1.5]
        # the row accepted 3 drafts but emitted 2 tokens: 1 draft and the one in its place
        assert (out.spec_verify_steps, out.spec_accepted_drafts) == (1, 1)
        assert out.spec_accepted_per_position[0] == 1 and not any(
            out.spec_accepted_per_position[1:])
        stats = core.core.spec_stats
        assert (stats.verify_steps, stats.accepted_drafts, stats.recent_accept_length) == (
            1, 1, 2.0)
        assert stats.accepted_per_position[0] == 1 and not any(stats.accepted_per_position[1:])
        acc = core.accounting()
        assert (acc["free_pages"], acc["free_slots"], acc["running"]) == (
            acc["total_pages"], acc["total_slots"], 0)


def test_text_before_a_stop_token_is_released_and_the_stop_token_has_none():
    core = make_scheduler()
    core.add_request("r", [5, 6], SamplingParams(max_new_tokens=20, stop=["<100><9>"]))
    outs = run(core, [100, 2])  # "<100>" could begin the stop string: held back until the end
    assert ["".join(o.text for o in outs)] == ["<100>"]
    assert outs[-1].token_ids == [2] and outs[-1].finish_reason == FinishReason.STOP
