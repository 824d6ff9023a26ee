"""Which device we run on (cuda / hip / cpu), and device-neutral events."""

from __future__ import annotations

import torch


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


def resolve_dtype(spec: str) -> torch.dtype:
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16}
    if spec not in table:
        raise ValueError(f"dtype '{spec}' is not supported; use one of bf16, fp32, fp16")
    return table[spec]


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
