"""The CUDA/HIP paths: streams, pinned copies, device-side invariant checks, same tokens as the
CPU. Skipped without a GPU; on a GPU machine the rest of the suite also runs there (device
"auto"), this module adds what only a GPU can show."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fmserve.engine import Engine
from gpu.future_map import FutureMap
from ipc.sampling import SamplingParams
from tests.engine_runs import assert_accounting_empty

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is 2+2?", "Name three colors.", "Write a haiku about rain.",
             "Explain gravity to a child.", "Say hi.", "List the planets in order."]


def greedy(engine: Engine, overlap: bool, max_new_tokens: int = 24) -> list[list[int]]:
    engine.overlap = overlap
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = [SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens - i)
              for i in range(len(chats))]
    out = [c.token_ids for c in engine.generate(chats, params)]
    assert_accounting_empty(engine)
    return out


@pytest.fixture(scope="module")
def cpu_reference(model_path) -> list[list[int]]:
    engine = Engine(model=str(model_path), device="cpu", dtype="fp32", max_kv_tokens=4096,
                    max_running_requests=8, progress=False)
    return greedy(engine, overlap=False)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_greedy_equals_the_cpu_with_overlap_on_and_off(model_path, cpu_reference, backend):
    engine = Engine(model=str(model_path), device="cuda", dtype="fp32", max_kv_tokens=4096,
                    max_running_requests=8, attention_backend=backend, progress=False)
    assert engine.worker.state.streams.enabled and engine.worker.launch_ahead == "prepare"
    assert greedy(engine, overlap=False) == cpu_reference
    assert greedy(engine, overlap=True) == cpu_reference


def test_cuda_graph_decode_equals_the_cpu(model_path, cpu_reference):
    """Captured decode graphs (buckets 1, 2, 4 and 6 for 6 requests that finish one by one, so
    5 and 3 replay with padding rows) give the CPU's tokens, with overlap off and on."""
    engine = Engine(model=str(model_path), device="cuda", dtype="fp32", max_kv_tokens=4096,
                    max_running_requests=8, attention_backend="triton", progress=False,
                    cuda_graph_max_batch=6)
    graphs = engine.worker.step.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 6]
    assert greedy(engine, overlap=False) == cpu_reference
    replays = graphs.replays
    assert replays > 0
    assert greedy(engine, overlap=True) == cpu_reference
    assert graphs.replays > replays


def test_the_torch_backend_runs_without_graphs_and_graphs_refuse_it(model_path):
    """Graphs are on by default, so a backend that reads host lengths must still load (without
    them); asked for directly, the graphs refuse it and say which backend to use."""
    from gpu.decode_graphs import DecodeGraphs

    engine = Engine(model=str(model_path), device="cuda", dtype="fp32", max_kv_tokens=1024,
                    max_running_requests=2, attention_backend="torch", progress=False,
                    cuda_graph_max_batch=2)
    step = engine.worker.step
    assert step.decode_graphs is None
    with pytest.raises(ValueError, match="triton"):
        DecodeGraphs(engine.worker.state.model, engine.worker.state.attn, 2)


def test_pinned_length_copy_follows_the_last_publish():
    fm = FutureMap(num_slots=6, device=torch.device("cuda"), wrwr_check=True)
    slots = torch.tensor([1, 4], device="cuda")
    fm.publish(slots, torch.tensor([7, 3], device="cuda"))
    assert fm.resolve_seq_lens_host(np.array([4, 1])).tolist() == [3, 7]
    fm.publish(slots[:1], torch.tensor([8], device="cuda"))
    assert fm.resolve_seq_lens_host(np.array([1, 4])).tolist() == [8, 3]


def test_launch_returns_a_pending_step_finished_in_order(model_path):
    """Two steps launched before either is finished (the worker's launch-ahead order) give
    the tokens of the same two steps run one after the other."""
    kwargs = dict(model=str(model_path), device="cuda", dtype="fp32", max_kv_tokens=4096,
                  max_running_requests=8, progress=False)
    chat = [[{"role": "user", "content": "Count to five."}]]
    want = Engine(**kwargs).generate(chat, SamplingParams(temperature=0.0, max_new_tokens=12))
    engine = Engine(**kwargs, overlap=True)
    got = engine.generate(chat, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert got[0].token_ids == want[0].token_ids


@pytest.mark.parametrize("case, message", [
    ("double_write", "double write"),
    ("read_before_write", "read before write"),
])
def test_wrwr_violations_fail_loudly_on_the_device(case, message):
    # A device-side assert poisons the CUDA context, so each case runs in its own process.
    script = textwrap.dedent(f"""
        import torch
        from gpu.future_map import FutureMap
        fm = FutureMap(num_slots=4, device=torch.device("cuda"), wrwr_check=True)
        s = torch.tensor([2], device="cuda")
        if "{case}" == "double_write":
            fm.stash(s, torch.tensor([5], device="cuda"))
            fm.stash(s, torch.tensor([6], device="cuda"))
        else:
            fm.resolve_future(s)
        torch.cuda.synchronize()
        print("NO ERROR")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "NO ERROR" not in proc.stdout, proc.stdout + proc.stderr
    assert message in proc.stderr or "device-side assert" in proc.stderr, proc.stderr[-2000:]
