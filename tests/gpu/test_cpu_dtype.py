"""What dtype "auto" means for a GGUF on a CPU with native bf16 (gpu/cpu_dtype.py): fp32 on the
codes unless the CPU has AMX, fixable by $FMSERVE_CPU_DTYPE; and which workers it applies to."""

from __future__ import annotations

import pytest
import torch

from gpu import cpu_dtype
from ipc.worker_config import ModelSettings, ParallelSettings, RuntimeSettings, WorkerConfig

@pytest.mark.parametrize("amx, expected", [(False, torch.float32), (True, torch.bfloat16)],
                         ids=["avx512-bf16", "amx"])
def test_fp32_on_the_codes_unless_the_cpu_has_amx(monkeypatch, amx, expected):
    monkeypatch.delenv(cpu_dtype.ENV_DTYPE, raising=False)
    monkeypatch.setattr(cpu_dtype, "cpu_has_amx", lambda: amx)
    if not cpu_dtype.codes_kernel_runs():
        expected = torch.bfloat16  # no C kernel to run the codes on
    assert cpu_dtype.auto_dtype_for_codes() == expected


def test_the_cpu_flags_are_read():
    from gpu.device import cpu_flags, cpu_has_amx, cpu_has_native_bf16
    flags = cpu_flags()
    assert "sse2" in flags or not flags  # an x86-64 CPU, or a system without /proc/cpuinfo
    assert cpu_has_amx() == ("amx_bf16" in flags)
    assert cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_the_environment_fixes_the_choice(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_has_amx", lambda: False)  # the rule would say fp32
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
    assert cpu_dtype.codes_dtype_applies(cfg, torch.device(device)) is applies
