"""What `model.dtype = "auto"` means for a quantized GGUF on a CPU with native bf16: bf16 on
torch's int4 kernel (gpu/q4_linear.py), or fp32 on fmserve's C kernel over the file's 4-bit
codes (gpu/cpu_kernels.py, gpu/cpu_q4_kernel.py, and the whole decode step in C).

The CPU's flags do not decide it. On a 2-core AMD EPYC with AVX512-BF16 and no AMX, the default
model offline, greedy, 64 tokens a request (tok/s including prefill, two runs each):

    batch                           1        8          32
    bf16, int4 kernel, compiled   57-70    115-123    147-156    (ready in 50 s: the compile)
    fp32, C kernel on the codes   82       168-173    209-215    (ready in 3.6 s)

So on such a CPU both are timed once, on one projection of the default model's MLP shape at
one row and at 32 (the C side at its measured hand-over to scratch dequantization), and the
answer is kept in the fmserve cache dir beside the hand-over, keyed by the CPU, its flags,
torch's version and the thread count. Where the C kernel cannot run (no C compiler, no FBGEMM),
bf16 it is. A CPU without native bf16 is fp32 without measuring (gpu/device.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import torch

from gpu import cpu_q4_kernel
from gpu.cpu_kernels import BUSY_CORES, best_ms, cpu_key, int4_max_rows
from gpu.cpu_q4_kernel import CodesLinear
from gpu.loader.gguf_q4 import Q4_GROUP, Int4Weight, Q4Blocks
from gpu.q4_linear import Q4Linear, q4_kernel_available
from ipc.cache_dirs import model_cache_dir
from ipc.worker_config import DEFAULT_Q4_MAX_TOKENS, WorkerConfig

log = logging.getLogger(__name__)

# The projection timed: the default model's gate/up (576 -> 2 x 1536), the widest of its layers.
SHAPE = (576, 3072)
ROWS = (1, 32)  # one stream, and a full batch
# Fixes the choice instead of measuring it ("bf16" or "fp32"): the test suite sets it, so every
# worker of a run makes the same choice on a busy machine (tests/conftest.py).
ENV_DTYPE = "FMSERVE_CPU_DTYPE"


def codes_kernel_runs() -> bool:
    """Whether the fp32 path on the codes can run here at all."""
    return (cpu_q4_kernel.available() and q4_kernel_available()
            and "fbgemm" in torch.backends.quantized.supported_engines)


def measure_codes_speedup(in_features: int = SHAPE[0], out_features: int = SHAPE[1]) -> float:
    """How many times faster the C kernel's projection (fp32 activations) is than the int4
    kernel's (bf16 activations) on a random 4-bit weight: the geometric mean over ROWS."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=gen)
    groups = in_features // Q4_GROUP
    weight = Int4Weight(Q4Blocks(codes, torch.rand(out_features, groups, generator=gen) * 0.01,
                                 -torch.rand(out_features, groups, generator=gen) * 0.05),
                        in_features)
    bf16 = Q4Linear(weight, DEFAULT_Q4_MAX_TOKENS)
    on_codes = CodesLinear(weight, int4_max_rows(in_features, out_features))
    ratios = []
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        xb = x.to(torch.bfloat16)
        # Interleaved pairs: a machine busy with other work slows both alike.
        t_bf16 = min(best_ms(bf16, xb) for _ in range(2))
        t_codes = min(best_ms(on_codes, x) for _ in range(2))
        ratios.append(t_bf16 / t_codes)
    return math.sqrt(ratios[0] * ratios[1])


def auto_dtype_for_codes(cache: bool = True) -> torch.dtype:
    """fp32 where the C kernel on the codes is the faster, else bf16 (measured once, cached;
    $FMSERVE_CPU_DTYPE, where set, decides instead)."""
    if fixed := os.environ.get(ENV_DTYPE, "").strip():
        if fixed not in ("bf16", "fp32"):
            raise ValueError(f"{ENV_DTYPE}={fixed!r}: give bf16 or fp32 (what model.dtype "
                             f"'auto' means for a GGUF on this CPU), or unset it to measure")
        return torch.float32 if fixed == "fp32" and codes_kernel_runs() else torch.bfloat16
    if not codes_kernel_runs():
        return torch.bfloat16
    path = model_cache_dir() / "cpu_kernels.json"
    key = "dtype:" + cpu_key(*SHAPE)
    known: dict = {}
    if cache and path.exists():
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if known.get(key) in ("fp32", "bf16"):
            return torch.float32 if known[key] == "fp32" else torch.bfloat16
    start = time.perf_counter()
    speedup = measure_codes_speedup()
    choice = "fp32" if speedup > 1.0 else "bf16"
    log.info("CPU dtype: the C kernel on the 4-bit codes runs %.2fx the int4 kernel's speed in "
             "bf16, so dtype auto is %s (measured in %.2f s)", speedup, choice,
             time.perf_counter() - start)
    busy = os.getloadavg()[0] - 1.0
    if cache and busy <= BUSY_CORES * (os.cpu_count() or 1):
        known = known if isinstance(known, dict) else {}
        known[key] = choice
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known, indent=1))
        except OSError as exc:
            log.warning("could not cache the CPU dtype choice in %s: %s", path, exc)
    return torch.float32 if choice == "fp32" else torch.bfloat16


def codes_dtype_measured(cfg: WorkerConfig, device: torch.device) -> bool:
    """Whether `auto_dtype_for_codes` settles dtype "auto" for this worker: a GGUF (whose
    projections may keep their codes) on one CPU rank that keeps codes (the defaults). Ranks
    of a group keep bf16: each would time itself, and they must agree."""
    rt = cfg.runtime
    return (device.type == "cpu" and cfg.model.dtype == "auto" and cfg.weight_quant == "none"
            and rt.cpu_fp32_weights == "split" and rt.q4_max_tokens > 0
            and cfg.parallel.tp == 1 and str(cfg.model.path).lower().endswith(".gguf"))
