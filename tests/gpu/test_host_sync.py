"""Launching a step never makes the host wait for the device (gpu/sync_guard.py).

Overlap scheduling only pays on a GPU if `ModelRunner.launch` enqueues work and returns: one
`.item()`, `if tensor:` or boolean-mask index in it and the host stalls until the forward in
flight ends. On the CPU the guard emulates PyTorch's CUDA sync check, so these tests keep the
plain step, the EAGLE step (chain, tree, sampled acceptance, logprobs, penalties) and the
speculation-off fallback free of hidden syncs without a GPU; on CUDA they use the real check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fmserve.engine import Engine
from gpu.sync_guard import HostSyncError, expected_sync, no_host_sync
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from tests.engine_runs import assert_accounting_empty

CHATS = [[{"role": "user", "content": q}] for q in
         ("Hi there, how are you doing today?", "Name a color.", "Count to five.", "Why?")]
# Greedy, sampled with every filter and logprobs, penalties with a min-token ban, min-p.
PARAMS = [SamplingParams(temperature=0, max_new_tokens=6),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_new_tokens=6,
                         logprobs=2),
          SamplingParams(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.3,
                         frequency_penalty=0.2, min_new_tokens=3, max_new_tokens=6, seed=2),
          SamplingParams(temperature=0, min_p=0.1, max_new_tokens=5, logprobs=0)]
SPECS = {
    "plain": None,
    "chain": SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                          disable_above_batch_size=0),
    "tree": SpecSettings("eagle3", "", num_steps=3, topk=2, num_draft_tokens=6,
                         disable_above_batch_size=0),
    # Above 2 requests the EAGLE step decodes without drafting (decode_plain).
    "tree, off above 2": SpecSettings("eagle3", "", num_steps=3, topk=2, num_draft_tokens=6,
                                      disable_above_batch_size=2),
}


def guarded_engine(spec: SpecSettings | None, **guard) -> tuple[Engine, list[int]]:
    """An engine whose every launch runs under no_host_sync(**guard); the count of guarded
    launches."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = Engine(model="default", device=device, dtype="fp32",
                    attention_backend="triton" if device == "cuda" else "torch", page_size=4,
                    max_kv_tokens=2048, max_running_requests=4, max_tokens_per_step=32,
                    progress=False, spec=spec)
    engine.worker.state.future_map.wrwr_check = False  # the debug check reads on purpose
    runner, launch, launches = engine.worker, engine.worker.launch, [0]

    def launch_guarded(plan):
        with no_host_sync(runner.state.device, **guard):
            launches[0] += 1
            return launch(plan)

    runner.launch = launch_guarded
    return engine, launches


# Overlap changes the plans (decode tokens come from the FutureMap), not the launch code: each
# step kind once, overlap on where plans differ most.
CASES = [("plain", False), ("plain", True), ("chain", True), ("tree", False),
         ("tree, off above 2", True)]


@pytest.mark.parametrize("name,overlap", CASES,
                         ids=[f"{n}-overlap {'on' if o else 'off'}" for n, o in CASES])
def test_launch_never_waits_for_the_device(name, overlap):
    engine, launches = guarded_engine(SPECS[name])
    engine.overlap = overlap
    finished = [o for o in engine.stream(CHATS, PARAMS) if o.finished]
    assert len(finished) == len(CHATS)
    assert launches[0] > 6  # prefill chunks and decode steps all ran guarded
    assert_accounting_empty(engine)


def test_the_guard_catches_each_kind_of_sync(tmp_path, monkeypatch):
    """Each operation that would make a host wait on a GPU is refused when called from an
    audited file, and allowed from elsewhere or inside expected_sync()."""
    probe = tmp_path / "probe_syncs.py"
    probe.write_text(
        "import torch\n"
        "x = torch.arange(6)\n"
        "m = x > 2\n"
        "CASES = {\n"
        "  'item': lambda: x.sum().item(), 'bool': lambda: bool(m.any()),\n"
        "  'if': lambda: 1 if m[0] else 0, 'int': lambda: int(x.max()),\n"
        "  'mask index': lambda: x[m], 'mask assign': lambda: x.clone().__setitem__(m, 0),\n"
        "  'nonzero': lambda: m.nonzero(), 'cpu': lambda: x.cpu(),\n"
        "  'repeat_interleave': lambda: torch.repeat_interleave(x, x),\n"
        "  'to device': lambda: x.to('cpu'),\n"
        "  'tensor on device': lambda: torch.tensor([1, 2], device='cpu'),\n"
        "}\n"
        "FINE = {\n"
        "  'repeat_interleave sized': lambda: torch.repeat_interleave(x, x, output_size=15),\n"
        "  'long index': lambda: x[torch.tensor([1, 2])], 'shape': lambda: int(x.shape[0]),\n"
        "  'to non_blocking': lambda: x.to('cpu', non_blocking=True),\n"
        "  'host tensor': lambda: torch.tensor([1, 2]), 'where': lambda: torch.where(m, x, 0),\n"
        "}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import probe_syncs

    cpu = torch.device("cpu")
    for name, case in probe_syncs.CASES.items():
        with no_host_sync(cpu, audited=(str(tmp_path),)):
            with pytest.raises(HostSyncError, match="probe_syncs.py"):
                case()
            with expected_sync():
                case()
        with no_host_sync(cpu):  # not an audited file
            case()
    with no_host_sync(cpu, audited=(str(tmp_path),)):
        for name, case in probe_syncs.FINE.items():
            case()
    sys.modules.pop("probe_syncs", None)


def test_a_sync_in_the_launch_path_is_caught(monkeypatch):
    """The guard sees through the real runner: a boolean read put back into the FutureMap's
    resolve (the kind of line this file exists to keep out) fails the launch."""
    import gpu.future_map as fm

    resolve = fm.FutureMap.resolve_future

    def resolve_and_peek(self, slots):
        tokens = resolve(self, slots)
        if bool((tokens < 0).any()):  # a host read of device data
            raise AssertionError("a stashed token was missing")
        return tokens

    monkeypatch.setattr(fm.FutureMap, "resolve_future", resolve_and_peek)
    # The patched function lives in this file: audit it beside gpu/.
    engine, _ = guarded_engine(None, audited=(str(Path(fm.__file__).parent), __file__))
    if engine.worker.state.device.type == "cuda":  # PyTorch's own check
        with pytest.raises(RuntimeError, match="synchroniz"):
            list(engine.stream(CHATS[:1], PARAMS[:1]))
    else:
        with pytest.raises(HostSyncError, match="resolve_and_peek"):
            list(engine.stream(CHATS[:1], PARAMS[:1]))


def test_runtime_sync_check_guards_the_runners_own_launches(monkeypatch):
    """runtime.sync_check / FMSERVE_SYNC_CHECK: the runner guards prepare and launch_prepared
    itself (the service's worker, the soak test). A host read compiled as if it were a line of
    gpu/future_map.py must fail the launch with it on and pass with it off."""
    import gpu.future_map as fm

    namespace = {"resolve": fm.FutureMap.resolve_future}
    exec(compile("def resolve_and_peek(self, slots):\n"
                 "    tokens = resolve(self, slots)\n"
                 "    assert not bool((tokens < 0).any())\n"
                 "    return tokens\n", fm.__file__, "exec"), namespace)
    monkeypatch.setattr(fm.FutureMap, "resolve_future", namespace["resolve_and_peek"])
    for on in (True, False):
        monkeypatch.setenv("FMSERVE_SYNC_CHECK", "1" if on else "0")
        engine = Engine(model="default", dtype="fp32", page_size=4, max_kv_tokens=2048,
                        max_running_requests=4, progress=False)
        assert engine.worker.state.sync_check == on
        engine.worker.state.future_map.wrwr_check = False
        if not on:
            assert len(engine.generate(CHATS[:1], PARAMS[0])[0].token_ids) == 6
            continue
        error = HostSyncError if engine.worker.state.device.type == "cpu" else RuntimeError
        with pytest.raises(error):
            list(engine.stream(CHATS[:1], PARAMS[:1]))
