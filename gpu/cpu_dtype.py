"""What `model.dtype = "auto"` means for a quantized GGUF on a CPU with native bf16: bf16 on
torch's int4 kernel (gpu/q4_linear.py, the step compiled by torch.compile), or fp32 on the file's
4-bit codes, where the whole decoder runs as one call into fmserve's C step (gpu/cpu_kernels.py,
gpu/cpu_q4_kernel.py, gpu/cpu_decode_step.py).

Measured on a 2-core AMD EPYC with AVX512-BF16 and no AMX, the default model offline, greedy,
64 tokens a request (tok/s including prefill, two runs each):

    batch                           1        8          32
    bf16, int4 kernel, compiled   57-70    115-123    147-156    (ready in 50 s: the compile)
    fp32, the C step on the codes   82     168-173    209-215    (ready in 3.6 s)

A projection alone does not tell this: on that CPU the int4 kernel multiplies 4-32 rows
1.15-1.35x faster than the C kernel (the C kernel wins at one row, 1.22x), so timing one
projection at start-up picked bf16 about half the time. What wins is the C step running every
layer in one call, against torch's per-op costs in a step that compiles only for batch 1. So
the rule is by the matrix unit: with AMX (whose tiles multiply bf16 several times faster than
AVX-512, where fmserve measured 375-400 tok/s at 32 streams in bf16) bf16; otherwise fp32 on the
codes wherever the C kernel runs (a C compiler, FBGEMM). A CPU without native bf16 is fp32
anyway (gpu/device.py).
"""

from __future__ import annotations

import os

import torch

from gpu import cpu_q4_kernel
from gpu.device import cpu_has_amx
from gpu.q4_linear import q4_kernel_available
from ipc.worker_config import WorkerConfig

# Fixes the choice ("bf16" or "fp32"): the test suite sets it, keeping the suite's workers on
# the dtype they ran before on such CPUs (tests/conftest.py).
ENV_DTYPE = "FMSERVE_CPU_DTYPE"


def codes_kernel_runs() -> bool:
    """Whether the fp32 path on the codes can run here at all."""
    return (cpu_q4_kernel.available() and q4_kernel_available()
            and "fbgemm" in torch.backends.quantized.supported_engines)


def auto_dtype_for_codes() -> torch.dtype:
    """fp32 on the codes on a CPU without AMX where the C kernel runs, else bf16;
    $FMSERVE_CPU_DTYPE, where set, decides instead."""
    if fixed := os.environ.get(ENV_DTYPE, "").strip():
        if fixed not in ("bf16", "fp32"):
            raise ValueError(f"{ENV_DTYPE}={fixed!r}: give bf16 or fp32 (what model.dtype "
                             f"'auto' means for a GGUF on this CPU), or unset it")
        return torch.float32 if fixed == "fp32" and codes_kernel_runs() else torch.bfloat16
    return torch.float32 if codes_kernel_runs() and not cpu_has_amx() else torch.bfloat16


def codes_dtype_applies(cfg: WorkerConfig, device: torch.device) -> bool:
    """Whether `auto_dtype_for_codes` settles dtype "auto" for this worker: a GGUF (whose
    projections may keep their codes) on one CPU rank that keeps codes (the defaults). Ranks
    of a tensor-parallel group keep bf16 (the C step runs one rank's whole model)."""
    rt = cfg.runtime
    return (device.type == "cpu" and cfg.model.dtype == "auto" and cfg.weight_quant == "none"
            and rt.cpu_fp32_weights == "split" and rt.q4_max_tokens > 0
            and cfg.parallel.tp == 1 and str(cfg.model.path).lower().endswith(".gguf"))
