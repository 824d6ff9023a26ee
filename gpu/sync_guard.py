"""Catch the host waiting for the device in code that should only enqueue work.

Overlap scheduling only pays if launching a step never makes the host wait for the device:
one `.item()`, `if tensor:` or boolean-mask index in the launch path and the host stalls until
the forward in flight is done, and plan k+1 is no longer built while step k runs.

`no_host_sync()` guards a region:
- on CUDA it is PyTorch's own check, `torch.cuda.set_sync_debug_mode("error")`: every
  synchronising call raises;
- on the CPU nothing ever waits, so it emulates that check: a TorchFunctionMode refuses the
  operations that would synchronise on a device (reading a value to the host, shapes that
  depend on values) when they are called from the files it audits (this repository's `gpu/`
  by default). Kernels' own internals (Triton's interpreter, torch's Python code) are not
  audited: the caller that counts is the first frame outside torch.

So the CPU test suite keeps the GPU launch path free of hidden syncs without a GPU
(tests/gpu/test_host_sync.py), and `runtime.sync_check` (or FMSERVE_SYNC_CHECK=1) runs every
launch of a service's worker under it (the soak test does).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_GPU_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_THIS_FILE = os.path.abspath(__file__)
# Works on the host lengths it declares it needs (needs_cpu_seq_lens): on a GPU, use Triton.
_HOST_LENGTH_BACKENDS = tuple(os.path.join(_GPU_DIR, "attention", name) for name in
                              ("torch_backend.py", "batch_invariant_backend.py"))


def sync_check_from_env() -> bool:
    return os.environ.get("FMSERVE_SYNC_CHECK", "0").lower() in ("1", "true", "yes", "on")


class HostSyncError(RuntimeError):
    """An operation in a guarded region would make the host wait for the device."""


T = torch.Tensor
# Always a sync on a device: the value (or its size) has to come to the host.
_ALWAYS = {
    T.item: "reads a value to the host (.item())",
    T.tolist: "reads values to the host (.tolist())",
    T.numpy: "reads values to the host (.numpy())",
    T.cpu: "copies to the host (.cpu())",
    T.__bool__: "tests a tensor's value on the host (if/bool)",
    T.__int__: "reads a value to the host (int())",
    T.__float__: "reads a value to the host (float())",
    T.__index__: "reads a value to the host (used as a Python index)",
    T.nonzero: "has a value-dependent size (nonzero)",
    torch.nonzero: "has a value-dependent size (nonzero)",
    T.argwhere: "has a value-dependent size (argwhere)",
    torch.argwhere: "has a value-dependent size (argwhere)",
    T.masked_select: "has a value-dependent size (masked_select)",
    torch.masked_select: "has a value-dependent size (masked_select)",
    T.unique: "has a value-dependent size (unique)",
    torch.unique: "has a value-dependent size (unique)",
    torch.unique_consecutive: "has a value-dependent size (unique_consecutive)",
    T.bincount: "reads the maximum to the host (bincount)",
    torch.bincount: "reads the maximum to the host (bincount)",
}
_INDEXING = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put, torch.index_put}
_REPEAT = {T.repeat_interleave, torch.repeat_interleave}
_FACTORIES = {torch.tensor, torch.as_tensor}
# Every function `_why_it_syncs` looks at: the check costs one set lookup for the rest (a
# guarded step calls thousands of torch functions; the test suite runs every step guarded).
_WATCHED = frozenset(_ALWAYS) | _INDEXING | _REPEAT | _FACTORIES | {torch.where, T.to}


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _names_device(args, kwargs) -> bool:
    """Whether Tensor.to's arguments name a device (not only a dtype)."""
    if kwargs.get("device") is not None:
        return True
    return bool(args) and isinstance(args[0], (torch.device, str, int))


def _why_it_syncs(func, args, kwargs) -> str | None:
    """Why `func(*args, **kwargs)` would make the host wait on a device; None if it would not."""
    why = _ALWAYS.get(func)
    if why is not None:
        return why
    if func in _INDEXING and len(args) > 1 and _has_bool_index(args[1]):
        return "indexes with a boolean mask (a value-dependent size); use a static shape"
    if func in _REPEAT and kwargs.get("output_size") is None:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and repeats.numel() > 1:
            return "repeat_interleave with tensor repeats and no output_size"
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "has a value-dependent size (one-argument torch.where)"
    if func is T.to and not kwargs.get("non_blocking") and not (
            len(args) > 2 and args[2] is True) and _names_device(args[1:], kwargs):
        return ("copies to a device without non_blocking (from the host it blocks); use "
                "gpu.device.host_to_device")
    if func in _FACTORIES and kwargs.get("device") is not None:
        return ("builds a tensor from host data directly on the device (a blocking copy); "
                "use gpu.device.host_to_device")
    return None


def _caller() -> tuple[str, int, str]:
    """The first frame outside torch and this file: the code that asked for the operation."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_DIR) or path == _THIS_FILE):
            return path, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return "", 0, ""


_expected_depth = 0


@contextmanager
def expected_sync() -> Iterator[None]:
    """Marks a host read the design calls for: one on a CPU-only path (reading is free there),
    the host lengths an attention backend that declares `needs_cpu_seq_lens` asks for, a debug
    check that reads on purpose. Both checks let it pass (on the CPU the emulation cannot tell
    host tensors from device ones)."""
    global _expected_depth
    # is_initialized alone: cheap where no GPU is (this runs on the CPU's hot paths too)
    cuda_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_initialized() else 0
    if cuda_mode:
        torch.cuda.set_sync_debug_mode(0)
    _expected_depth += 1
    try:
        yield
    finally:
        _expected_depth -= 1
        if cuda_mode:
            torch.cuda.set_sync_debug_mode(cuda_mode)


class _EmulatedSyncCheck(TorchFunctionMode):
    def __init__(self, audited: tuple[str, ...], exempt: tuple[str, ...]) -> None:
        super().__init__()
        self.audited, self.exempt = audited, exempt

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _WATCHED or _expected_depth:
            return func(*args, **kwargs)
        why = _why_it_syncs(func, args, kwargs)
        if why is not None:
            path, line, name = _caller()
            if path.startswith(self.audited) and not path.startswith(self.exempt):
                raise HostSyncError(
                    f"{os.path.relpath(path)}:{line} in {name}: "
                    f"{getattr(func, '__name__', func)} {why}; on a GPU the host would wait "
                    f"here for the device (no_host_sync)")
        return func(*args, **kwargs)


@contextmanager
def no_host_sync(device: torch.device, audited: tuple[str, ...] = (_GPU_DIR,),
                 exempt: tuple[str, ...] = _HOST_LENGTH_BACKENDS) -> Iterator[None]:
    """Raise on any host<->device synchronisation inside the block (see the module doc);
    on the CPU, from files under `audited` other than those under `exempt`."""
    if device.type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    with _EmulatedSyncCheck(tuple(os.path.abspath(a) for a in audited),
                            tuple(os.path.abspath(e) for e in exempt)):
        yield
