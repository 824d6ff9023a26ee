"""Which kernel multiplies a quantized GGUF's projections on a CPU without native bf16.

A CPU with AVX512-BF16 or AMX runs the model in bf16 and every small forward on the file's
4-bit codes (gpu/q4_linear.py). An AVX2-only CPU runs the model in fp32 (bf16 matmuls are
emulated there), and used to hold every projection as a dense fp32 copy: 8x the bytes of the
codes, read once per decode step. Measured on a 2-core AVX2-only EPYC, SmolLM2-135M's 120
projections (ms per forward, best of 5):

    rows                    1      8     32
    fp32 dense (MKL)       40     92     95
    int4 codes, bf16 act   14     26    361
    fp16 (FBGEMM)          19     26     48

So on such a CPU a projection keeps only the codes: few rows run fmserve's C kernel on them
(gpu/cpu_q4_kernel.py: 6.4 ms at one row), many rows (prefill) dequantize the weight a piece
at a time into a reused fp32 buffer for torch's GEMM (`scratch_matmul`: 0.16 ms to dequantize
the 3072x576 gate/up projection, 1.0-1.2x FBGEMM fp16's time from 64 rows up, 1.3x at
128-256), with no dense copy resident (FBGEMM packs used to hold 2 bytes a weight beside the
codes). Where one hands over to the other differs between CPUs, so it is measured once on
this machine at start-up (a few hundred ms on one projection shape) and kept in the fmserve
cache dir, keyed by the CPU, its flags, torch's version and the shape. Without a C compiler
torch's int4 kernel takes the few rows and FBGEMM fp16 packs the many.

Only `model.dtype = "auto"` takes this path: an explicit "fp32" keeps the exact dense fp32
weights (the references the tests compare against).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass

import torch

from gpu import c_library, cpu_q4_kernel
from gpu.cpu_info import cpu_flag_list, cpu_model
from gpu.cpu_load import OtherWork
from gpu.cpu_q4_kernel import Q4Rows
from gpu.device import cpu_has_native_bf16
from gpu.loader.gguf_q4 import Q4_GROUP, Int4Weight, Q4Blocks
from gpu.q4_linear import q4_kernel_available
from gpu.quantized_linear import Fp16Linear
from ipc.cache_dirs import model_cache_dir

log = logging.getLogger(__name__)

# The row counts the hand-over is chosen among: decode batches and EAGLE verifies up to 128,
# then prefill chunks (runtime.max_tokens_per_step is 2048 by default). With its input
# quantized in vectors, the C kernel ran 2x the bf16 scratch GEMM at 128-256 rows and 1.3x at
# 2048 on an AVX512-BF16 EPYC: there the codes take prefill too.
CANDIDATE_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048)
# An lm_head multiplies a forward's last rows only (one per request, or an EAGLE verify's few
# per request): its hand-over is looked for up to here.
LM_HEAD_CANDIDATE_ROWS = 256
# The hand-over where the kernel kept up at every candidate: it takes forwards of any size.
UNBOUNDED_ROWS = 1 << 30
CALIBRATION_REPEATS = 5
# Part of the cache key: hand-overs cached by an earlier way of measuring are measured again
# (2: a loss confirmed, other work read from /proc/stat).
CALIBRATION_VERSION = 2
# Above this many cores kept busy by other processes while it ran (gpu/cpu_load.py), a
# measurement is used but not cached: a test run beside one once cached a hand-over of 1 row
# where the kernel was 1.6-25x faster at every size, and prefill ran 1.4x slower after.
BUSY_CORES = 0.25
# Fixes the hand-over instead of measuring it (a few seconds on a busy 2-core machine, at every
# start while it stays busy): the test suite sets it, as it sets FMSERVE_COMPILE.
ENV_CODES_ROWS = "FMSERVE_CPU_CODES_ROWS"
# A wider lm_head (Gemma 3's 262,144 tokens) is measured on this many of its outputs: the
# hand-over depends on the rows, and a full-size random copy would cost ~1 GB for a moment.
CALIBRATION_MAX_OUT = 32768


@dataclass(frozen=True)
class Fp32Split:
    """Up to how many rows the codes take a forward (FBGEMM fp16 above); 0: never."""

    projection_rows: int
    lm_head_rows: int
    bf16_gemm: bool = False  # wide forwards multiply in bf16 (a CPU with native bf16)


def fp32_split_applies(device: torch.device, dtype: torch.dtype, dtype_setting: str,
                       max_tokens: int, weights: str = "split") -> bool:
    """Whether an fp32 model on `device` keeps its quantized projections as codes + fp16
    (`runtime.cpu_fp32_weights`)."""
    return (weights == "split" and device.type == "cpu" and dtype == torch.float32
            and dtype_setting == "auto"
            and max_tokens > 0 and q4_kernel_available()
            and "fbgemm" in torch.backends.quantized.supported_engines)


def machine_key() -> str:
    """What a timing on this machine depends on: the CPU model and flags, torch's version and
    threads, the C kernel's build. The EAGLE gate's kept measurements key on it too
    (gpu/eagle/gate_memory.py)."""
    model, flags = cpu_model(), " ".join(cpu_flag_list())
    # A new build of the C kernel (its sources changed) is timed afresh.
    kernel = (f"c+scratch-{c_library.build_key()}" if cpu_q4_kernel.available()
              else "torch+fbgemm")
    return f"{model}|{flags}|{torch.__version__}|{torch.get_num_threads()}|{kernel}"


def _cpu_key(in_features: int, out_features: int) -> str:
    raw = f"{machine_key()}|{in_features}x{out_features}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _best_ms(fn, x: torch.Tensor) -> float:
    fn(x)
    best = float("inf")
    for _ in range(CALIBRATION_REPEATS):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _int4_wins(int4, wide, x: torch.Tensor) -> bool:
    # Interleaved pairs: a machine busy with other work slows both alike.
    t_int4 = min(_best_ms(int4, x) for _ in range(2))
    t_wide = min(_best_ms(wide, x) for _ in range(2))
    return t_int4 <= t_wide


def measure_int4_max_rows(in_features: int, out_features: int, bf16: bool = False,
                          up_to: int = CANDIDATE_ROWS[-1]) -> int:
    """The most rows (of CANDIDATE_ROWS up to `up_to`) at which the 4-bit kernel is still at
    least as fast as the wide path (scratch dequantization with its GEMM in bf16 where `bf16`,
    else fp32; or FBGEMM fp16 without the C kernel) on a random [out, in] weight; 0 where it
    never is, UNBOUNDED_ROWS where it always is."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.int32, generator=gen)
    scales_and_zeros = (torch.rand(in_features // Q4_GROUP, out_features, 2, generator=gen)
                        .to(torch.bfloat16))

    if cpu_q4_kernel.available():  # the kernels CodesLinear runs (gpu/cpu_q4_kernel.py)
        rows_form = Q4Rows.from_weight(Int4Weight(Q4Blocks(
            codes.to(torch.uint8), scales_and_zeros[..., 0].t().float(),
            scales_and_zeros[..., 1].t().float()), in_features))

        def int4(x: torch.Tensor) -> torch.Tensor:
            return cpu_q4_kernel.q4_matmul(x, rows_form)

        def wide(x: torch.Tensor) -> torch.Tensor:
            return cpu_q4_kernel.scratch_matmul(x, rows_form, bf16)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        wide = Fp16Linear(torch.randn(out_features, in_features, generator=gen) * 0.02)

        def int4(x: torch.Tensor) -> torch.Tensor:  # as Q4Linear runs it on fp32 activations
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), packed, Q4_GROUP, scales_and_zeros).float()

    best = 0
    for rows in (r for r in CANDIDATE_ROWS if r <= up_to):
        x = torch.randn(rows, in_features, generator=gen)
        # A loss is confirmed once more: a moment of other work must not end the search.
        if not any(_int4_wins(int4, wide, x) for _ in range(2)):
            return best
        best = rows
    return UNBOUNDED_ROWS


def int4_max_rows(in_features: int, out_features: int, cache: bool = True,
                  bf16: bool = False, up_to: int = CANDIDATE_ROWS[-1]) -> int:
    """measure_int4_max_rows, cached per CPU, torch version, thread count and shape."""
    path = model_cache_dir() / "cpu_kernels.json"
    key = (_cpu_key(in_features, out_features) + ("-bf16" if bf16 else "") + f"-{up_to}"
           + f"-v{CALIBRATION_VERSION}")
    known: dict[str, int] = {}
    if cache and path.exists():
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        if isinstance(known.get(key), int):
            return known[key]
    start = time.perf_counter()
    with OtherWork() as other:
        rows = measure_int4_max_rows(in_features, out_features, bf16, up_to)
    log.info("CPU kernels: the int4 kernel takes forwards %s (measured in %.2f s)",
             "of any size" if rows == UNBOUNDED_ROWS else f"up to {rows} rows, the wide path "
             "above", time.perf_counter() - start)
    if cache and (other.cores is None or other.cores > BUSY_CORES):
        # Other work skews the pair of timings: use this answer, measure again next start.
        log.info("CPU kernels: other processes kept %s cores busy meanwhile: not caching the "
                 "hand-over", "unknown" if other.cores is None else f"{other.cores:.2f}")
    elif cache:
        known = known if isinstance(known, dict) else {}
        known[key] = rows
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(known, indent=1))
        except OSError as exc:  # a read-only cache costs a calibration per start, nothing else
            log.warning("could not cache the CPU kernel choice in %s: %s", path, exc)
    return rows


def plan_fp32_split(hidden: int, intermediate: int, vocab: int, cache: bool = True) -> Fp32Split:
    """The hand-over rows for a model's projections (measured on its MLP's up projection, the
    largest) and for its lm_head; $FMSERVE_CPU_CODES_ROWS, where set, gives both instead.
    On a CPU with native bf16 the wide path multiplies in bf16 (`scratch_matmul`) and the
    hand-over is measured against that. (With the C kernel's codes row by row, that hand-over
    fell to 16 rows, too few for the whole decoder in one C call, gpu/cpu_decode_step.py, so it
    was measured against the fp32 GEMM; with the codes interleaved 16 rows together the kernel
    keeps up with the bf16 GEMM to 128 rows on an AVX512-BF16 EPYC.)"""
    bf16 = cpu_has_native_bf16()
    if rows := os.environ.get(ENV_CODES_ROWS, "").strip():
        if not rows.isdigit():
            raise ValueError(f"{ENV_CODES_ROWS}={rows!r}: give a whole number of rows >= 0 "
                             f"(0: every forward on the fp16 packs), or unset it to measure")
        return Fp32Split(int(rows), int(rows), bf16)
    return Fp32Split(int4_max_rows(hidden, 2 * intermediate, cache, bf16),
                     int4_max_rows(hidden, min(vocab, CALIBRATION_MAX_OUT), cache, bf16,
                                   LM_HEAD_CANDIDATE_ROWS), bf16)
