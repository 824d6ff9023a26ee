"""What dtype "auto" means for a GGUF on a CPU with native bf16 (gpu/cpu_dtype.py): measured
once, cached per CPU, fixable by $FMSERVE_CPU_DTYPE; and which workers it applies to."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpu import cpu_dtype
from ipc.worker_config import ModelSettings, ParallelSettings, RuntimeSettings, WorkerConfig

needs_codes = pytest.mark.skipif(not cpu_dtype.codes_kernel_runs(),
                                 reason="the C kernel on the codes cannot run here (no compiler)")


@needs_codes
def test_the_two_kernels_are_timed_for_real():
    speedup = cpu_dtype.measure_codes_speedup(in_features=256, out_features=512)
    assert math.isfinite(speedup) and speedup > 0


@needs_codes
@pytest.mark.parametrize("speedup, expected", [(1.4, torch.float32), (0.7, torch.bfloat16)])
def test_the_faster_kernel_decides_and_the_answer_is_cached(tmp_path, monkeypatch, speedup,
                                                            expected):
    monkeypatch.delenv(cpu_dtype.ENV_DTYPE, raising=False)
    monkeypatch.setenv("FMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_dtype, "BUSY_CORES", 1e9)  # however busy the test machine is
    timings = []

    def measured() -> float:
        timings.append(speedup)
        return speedup

    monkeypatch.setattr(cpu_dtype, "measure_codes_speedup", measured)
    assert cpu_dtype.auto_dtype_for_codes() == expected
    assert cpu_dtype.auto_dtype_for_codes() == expected
    assert len(timings) == 1  # the second start read the cache
    cached = json.loads((tmp_path / "cpu_kernels.json").read_text())
    assert list(cached.values()) == ["fp32" if expected == torch.float32 else "bf16"]


@needs_codes
def test_a_choice_measured_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.delenv(cpu_dtype.ENV_DTYPE, raising=False)
    monkeypatch.setenv("FMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_dtype.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    monkeypatch.setattr(cpu_dtype, "measure_codes_speedup", lambda: 2.0)
    assert cpu_dtype.auto_dtype_for_codes() == torch.float32
    assert not (tmp_path / "cpu_kernels.json").exists()


def test_the_environment_fixes_the_choice(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "measure_codes_speedup", lambda: pytest.fail("measured"))
    monkeypatch.setenv(cpu_dtype.ENV_DTYPE, "bf16")
    assert cpu_dtype.auto_dtype_for_codes() == torch.bfloat16
    monkeypatch.setenv(cpu_dtype.ENV_DTYPE, "fp32")
    assert cpu_dtype.auto_dtype_for_codes() == (
        torch.float32 if cpu_dtype.codes_kernel_runs() else torch.bfloat16)
    monkeypatch.setenv(cpu_dtype.ENV_DTYPE, "fp16")
    with pytest.raises(ValueError, match="give bf16 or fp32"):
        cpu_dtype.auto_dtype_for_codes()


def config(path: str = "model.Q4_1.gguf", dtype: str = "auto", tp: int = 1,
           **runtime) -> WorkerConfig:
    return WorkerConfig(model=ModelSettings(path=path, dtype=dtype),
                        runtime=RuntimeSettings(**runtime), parallel=ParallelSettings(tp=tp))


@pytest.mark.parametrize("cfg, device, applies", [
    (config(), "cpu", True),
    (config(), "cuda", False),
    (config(path="model-dir/model.safetensors"), "cpu", False),  # no codes to run on
    (config(dtype="bf16"), "cpu", False),  # the user chose
    (config(tp=2), "cpu", False),  # ranks would each time themselves
    (config(cpu_fp32_weights="dense"), "cpu", False),
    (config(q4_max_tokens=0), "cpu", False),
], ids=["gguf", "gpu", "safetensors", "explicit", "ranks", "dense", "no-codes"])
def test_which_workers_it_decides_for(cfg, device, applies):
    assert cpu_dtype.codes_dtype_measured(cfg, torch.device(device)) is applies
