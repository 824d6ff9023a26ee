"""Training checkpoints: CPU tensors (so a run resumes on either device), the last few kept."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def to_cpu(obj):
    """``obj`` (nested dicts / lists / tuples) with every tensor on the CPU (CPU ones as is)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt"))
    return found[-1] if found else None


def save_checkpoint(ckpt_dir: Path, state: dict, keep: int) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{state['step']:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-max(1, keep)]:
        old.unlink(missing_ok=True)
    return path
