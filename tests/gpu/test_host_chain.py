"""A chain's drafting step bookkept on the host (gpu/eagle/host_chain.py) against the same step
kept on the device (EagleStep.draft_and_verify): the same tokens, the same drafts accepted at
every position, and the same target KV, draft KV and FutureMap relay written, on an engine
whose projections and head run on the C kernel's codes; requests it does not take (logprobs,
a temperature) run the device path in the same batches."""

from __future__ import annotations

import pytest
import torch

from gpu import cpu_q4_kernel
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings

pytestmark = pytest.mark.skipif(not cpu_q4_kernel.available(),
                                reason="the C kernel is not built here")

CHATS = [[{"role": "user", "content": q}] for q in (
    "Name three colors.", "Write a haiku about rain.", "What is 2+2?",
    "Explain gravity to a child in two sentences.")]


def _engines(model_path, monkeypatch, num_steps: int):
    """Two engines alike but for the host path (taken from the second)."""
    monkeypatch.setenv("FMSERVE_CPU_DTYPE", "fp32")
    monkeypatch.setenv("FMSERVE_CPU_CODES_ROWS", "8")  # two requests' verify rows on the codes
    from fmserve.engine import Engine
    spec = SpecSettings("eagle3", "", num_steps=num_steps, topk=1,
                        num_draft_tokens=num_steps + 1, disable_above_batch_size=0)
    host, device = (Engine(model=str(model_path), max_running_requests=2, progress=False,
                           spec=spec, compile="off") for _ in range(2))
    if host.worker.step.host_chain is None:
        pytest.skip("the model's projections are not on the C kernel's codes on this CPU")
    device.worker.step.host_chain = None
    return host, device


def _state(engine) -> dict[str, torch.Tensor]:
    """What a drafting step writes: target KV, draft KV, the FutureMap's relay."""
    st = engine.worker.state
    fm, draft_kv = st.future_map, engine.worker.step.drafter.draft_kv
    return {"k": torch.stack(list(st.kv_pool.k_buffer)), "v": torch.stack(list(st.kv_pool.v_buffer)),
            "draft_k": draft_kv.k_buffer[0], "draft_v": draft_kv.v_buffer[0],
            "lens": fm.new_seq_lens_buf, "tokens": fm.output_tokens_buf,
            "draft_ids": fm.topk_index_buf, "draft_hidden": fm.hidden_buf}


@pytest.mark.parametrize("num_steps", [1, 3])
def test_the_host_chain_writes_what_the_device_path_writes(model_path, monkeypatch, num_steps):
    host, device = _engines(model_path, monkeypatch, num_steps)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    outs = {name: e.generate(CHATS, params) for name, e in (("host", host), ("device", device))}
    assert host.worker.step.host_chain.runs > 0
    for a, b in zip(outs["host"], outs["device"]):
        assert a.token_ids == b.token_ids
        assert (a.spec_verify_steps, a.spec_accepted_per_position) == \
            (b.spec_verify_steps, b.spec_accepted_per_position)
    # A head that drafted from the wrong rows or positions would accept next to nothing.
    assert sum(o.spec_accepted_drafts for o in outs["host"]) > sum(
        o.spec_verify_steps for o in outs["host"]) * 0.3
    ours, theirs = _state(host), _state(device)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_requests_it_does_not_take_run_the_device_path_alongside(model_path, monkeypatch):
    """A greedy request beside one asking for logprobs, then beside a sampled one: those
    batches run the device path; the greedy request's tokens are its tokens alone."""
    host, device = _engines(model_path, monkeypatch, 3)
    step, device_steps = host.worker.step, []
    real = step.draft_and_verify
    monkeypatch.setattr(step, "draft_and_verify",
                        lambda *a, **k: device_steps.append(1) or real(*a, **k))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    alone = device.generate(CHATS[:1], greedy)[0].token_ids
    for other in (SamplingParams(temperature=0.0, max_new_tokens=24, logprobs=2,
                                 ignore_eos=True),
                  SamplingParams(temperature=0.8, seed=5, max_new_tokens=24, ignore_eos=True)):
        device_steps.clear()
        outs = host.generate(CHATS[:2], [greedy, other])
        assert outs[0].token_ids == alone
        assert len(outs[1].token_ids) == 24
        assert len(device_steps) >= 5  # the steps that held the other request
    runs = step.host_chain.runs
    assert host.generate(CHATS[:1], greedy)[0].token_ids == alone
    assert step.host_chain.runs > runs
