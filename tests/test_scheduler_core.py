"""SchedulerCore limits on its own, fed hand-made step results (no worker, no model)."""

from __future__ import annotations

from ipc.sampling import SamplingParams
from ipc.worker_messages import StepResult, WorkerInfo, pack_i32, unpack_i32
from service.request import FinishReason, RequestOutput
from service.scheduler_core import SchedulerConfig, SchedulerCore


class FakeTokenizer:
    """Enough of TextTokenizer for the detokenizer: token t reads "<t>"."""

    vocab_size = 1000

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def make_core(num_pages: int = 128, page_size: int = 4) -> SchedulerCore:
    info = WorkerInfo(protocol_version=1, model_name="fake", device="cpu", dtype="fp32",
                      attention_backend="torch", num_layers=2, vocab_size=1000,
                      max_context_len=512, page_size=page_size, num_pages=num_pages,
                      num_slots=5, eos_token_ids=[2])
    return SchedulerCore(info, FakeTokenizer(), SchedulerConfig())


def run(core: SchedulerCore, tokens: list[int], max_steps: int = 500) -> list[RequestOutput]:
    """Plan and answer steps until nothing can be planned; every sample of a step is the next
    of `tokens` (cycling)."""
    outs: list[RequestOutput] = []
    for step in range(max_steps):
        plan = core.plan_step()
        if plan is None:
            return outs
        sampled = [e.slot for e in plan.extends if e.sample] + unpack_i32(plan.decode_slots).tolist()
        outs += core.process_result(StepResult(
            step_id=plan.step_id, slots=pack_i32(sampled),
            token_ids=pack_i32([tokens[step % len(tokens)]] * len(sampled)), logprobs=b"",
            top_logprobs_n=0, top_logprob_ids=b"", top_logprobs=b"", forward_ms=1.0))
    raise AssertionError(f"still planning after {max_steps} steps")


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
    core = make_core()
    core.add_request("r", [5, 6], SamplingParams(max_new_tokens=10, min_new_tokens=3,
                                                 stop=["<101>"]))
    outs = [o for o in run(core, [100, 101, 102, 101, 103])]
    assert "".join(o.text for o in outs) == "<100><101><102>"
    assert [t for o in outs for t in o.token_ids] == [100, 101, 102, 101]
    assert outs[-1].finish_reason == FinishReason.STOP


def test_params_refused_against_the_vocabulary_name_the_request():
    # top_k and stop_token_ids are checked against the model's vocabulary here, at admission
    # (the codec does not know it): the error names the request like the codec's do.
    import pytest

    from service.scheduler_core import RequestRejected

    core = make_core()
    vocab = core.info.vocab_size
    for params in (SamplingParams(top_k=vocab + 1), SamplingParams(stop_token_ids=[vocab])):
        with pytest.raises(RequestRejected) as info:
            core.add_request("r-7", [1, 2, 3], params)
        assert info.value.code == "invalid_params"
        assert str(info.value).startswith("request 'r-7': sampling parameter")
    assert core.accounting()["waiting"] == 0
