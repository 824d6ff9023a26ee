"""Which device we run on (cuda / hip / cpu), and device-neutral events."""

from __future__ import annotations

import numpy as np
import torch

from gpu.cpu_info import cpu_flag_list


def resolve_device(spec: str = "auto") -> torch.device:
    """'auto' picks the GPU when present (CUDA and HIP both answer to torch.cuda), else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{spec}' was asked for but no CUDA/HIP GPU is visible; "
                         "use --device cpu or auto")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device '{spec}' is not supported; use auto, cpu or cuda[:N]")
    return device


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "hip" if torch.version.hip else "cuda"
    return "cpu"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; FMSERVE_CPU_ISA may hide the newer ones)."""
    return frozenset(cpu_flag_list())


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without either,
    bf16 matmuls are emulated and run several times slower than fp32 (measured: about 5x on
    an AVX2-only EPYC at batch 32)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_amx() -> bool:
    """True when the CPU has AMX's bf16 tile unit (Sapphire Rapids and later Xeons)."""
    return "amx_bf16" in cpu_flags()


def resolve_dtype(spec: str, device: torch.device | None = None) -> torch.dtype:
    """'auto' is bf16 on a GPU and on CPUs with native bf16, else fp32."""
    if spec == "auto":
        if device is not None and device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if spec not in table:
        raise ValueError(f"dtype '{spec}' is not supported; use one of auto, bf16, fp32, fp16")
    return table[spec]


def host_to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on the device without making the host wait for the device. A plain
    `.to(device)` synchronises the current stream after the copy (it would wait for the forward
    in flight); with non_blocking from pageable memory the driver stages the bytes at once and
    returns, so the array may be reused right away. Pinning each small array instead costs a
    pinned allocation per call. On the CPU: the data itself."""
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if device.type == "cpu":
        return t
    return t.to(device, non_blocking=True)


class NoOpEvent:
    """The CPU runs in program order: recording and waiting are nothing."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


def new_event(device: torch.device):
    """An event from the device's own module (torch.cuda.Event on CUDA/HIP), a no-op on CPU."""
    module = getattr(torch, device.type, None)
    event_cls = getattr(module, "Event", None) if device.type != "cpu" else None
    return event_cls() if event_cls is not None else NoOpEvent()
