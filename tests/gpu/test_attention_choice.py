"""runtime.attention_backend = "auto" and where decode CUDA graphs apply: triton on CUDA (its
kernels read no host lengths, so decode batches can be captured), torch on a CPU and in
deterministic mode; the graphs only on CUDA, with triton, on one rank."""

from __future__ import annotations

import msgspec
import pytest
import torch

from gpu.attention.factory import resolve_attention_backend
from gpu.worker import Worker
from ipc.worker_config import WorkerConfig

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_triton_on_cuda_and_torch_on_a_cpu_or_when_deterministic():
    assert resolve_attention_backend("auto", CUDA, deterministic=False) == "triton"
    assert resolve_attention_backend("auto", CPU, deterministic=False) == "torch"
    assert resolve_attention_backend("auto", CUDA, deterministic=True) == "torch"
    for name in ("torch", "triton"):  # a named backend is kept, wherever it runs
        assert resolve_attention_backend(name, CUDA, deterministic=False) == name
        assert resolve_attention_backend(name, CPU, deterministic=False) == name


def config(model: dict | None = None, **runtime) -> WorkerConfig:
    return msgspec.convert({"model": model or {}, "runtime": runtime}, WorkerConfig)


def test_deterministic_mode_takes_auto_or_torch_and_refuses_triton():
    config(deterministic=True).validate()
    config(deterministic=True, attention_backend="torch").validate()
    with pytest.raises(ValueError, match="deterministic = true needs runtime.attention_backend"):
        config(deterministic=True, attention_backend="triton").validate()


def test_graphs_on_by_default_are_refused_nowhere_and_skipped_where_they_cannot_apply(
        tiny_llama):
    cfg = config({"path": str(tiny_llama), "device": "cpu", "dtype": "fp32"},
                 max_kv_tokens=256, max_running_requests=4, compile="off")
    assert cfg.runtime.cuda_graph_max_batch > 0 and cfg.runtime.attention_backend == "auto"
    # tp ranks take the default too (the graphs hold no collectives, so they are skipped there)
    msgspec.convert({"parallel": {"tp": 2}}, WorkerConfig).validate()
    worker = Worker(cfg)
    assert worker.state.attention_backend == "torch"
    assert worker.state.info().attention_backend == "torch"
    assert worker.step.decode_graphs is None  # a CPU: nothing captured
    assert "CUDA graphs" not in worker.fast_paths()
