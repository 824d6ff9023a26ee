"""fmserve's C library for the CPU (gpu/csrc/): built, loaded and typed here, once a process.

The kernels on 4-bit and 8-bit codes (gpu/cpu_q4_kernel.py), the decode and head steps
(gpu/cpu_decode_step.py, gpu/eagle/head_native.py), the sampler's noise (gpu/cpu_sampling.py),
a load's fp32 conversions (gpu/loader/fp32_convert.py) and the dense fp32 projections
(gpu/dense_fp32.py) are one library, compiled at first
use with the system's C compiler (`cc -O3 -march=native -fopenmp`) into the fmserve cache dir,
keyed by the sources, the compiler and the CPU's flags. Without a compiler `available()` is
False and every caller keeps its torch path. A module of its own so that the layers and the
loader can reach it without importing the kernels' Linear classes.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from gpu.cpu_info import cpu_flag_list, cpu_isa
from ipc.cache_dirs import model_cache_dir

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# The kernels, the decode and head steps built on them, the sampler's noise, a load's fp32
# conversions and the dense fp32 projections: one library (the module's doc).
SOURCES = (CSRC / "q4_matmul.c", CSRC / "q8_matmul.c", CSRC / "decode_step.c",
           CSRC / "head_step.c", CSRC / "gumbel.c", CSRC / "sample_cut.c", CSRC / "load_ops.c",
           CSRC / "dense_fp32.c")
HEADERS = (CSRC / "q4_matmul.h", CSRC / "step_ops.h", CSRC / "attention_ops.h",
           CSRC / "vector_math.h", CSRC / "q8_tiles_fallback.h", CSRC / "gumbel.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# The library for this CPU ("native"), or without AVX-512 ("avx2": the AVX2 dot-product loop
# an AVX2-only CPU runs, built on a newer one to compare the two).
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",), "c": ("-march=x86-64",)}


def _cpu_flags() -> str:
    return " ".join(cpu_flag_list(capped=False))  # the build's own flags say what it may use


def _build(compiler: str, target: Path, flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed: two workers starting at once never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, "-o", str(built), *map(str, SOURCES)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)


def build_key(compiler: str = "", flags: tuple[str, ...] = FLAGS) -> str:
    """What a build of the library is named by: its sources, compiler, flags and the CPU's
    flags (the start-up calibration that times it keys on this too)."""
    text = b"".join(f.read_bytes() for f in SOURCES + HEADERS if f.exists())
    return hashlib.sha256(text + compiler.encode() + " ".join(flags).encode()
                          + _cpu_flags().encode()).hexdigest()[:16]


@cache
def _library(isa: str = "native") -> ctypes.CDLL | None:
    if os.environ.get("FMSERVE_NO_C_KERNEL"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None or not all(f.exists() for f in SOURCES + HEADERS):
        log.info("no C compiler found: 4-bit decode stays on torch's kernels")
        return None
    if isa == "native":  # FMSERVE_CPU_ISA=avx2 builds this CPU's library without AVX-512
        isa = cpu_isa()
    flags = FLAGS + ISA_FLAGS[isa]
    key = build_key(compiler, flags)
    target = model_cache_dir() / "cpu_kernels" / f"q4_matmul-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target, flags)
        lib = ctypes.CDLL(str(target))  # after torch: it shares torch's libgomp.so.1
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("could not build the C 4-bit kernel (%s): decode stays on torch's "
                    "kernels", str(detail).strip()[-500:])
        return None
    lib.q4_matmul.restype = ctypes.c_int
    lib.q4_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_int]
    lib.q8_matmul.restype = ctypes.c_int
    lib.q8_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.q8_matmul_argmax.restype = ctypes.c_int
    lib.q8_matmul_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_int]
    lib.q4_dequantize.restype = None
    lib.q4_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_int]
    lib.q8_dequantize.restype = None
    lib.q8_dequantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                  ctypes.c_int]
    lib.q8_lookup.restype = ctypes.c_int
    lib.q8_lookup.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 3 + [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.gguf_blocks_to_fp32.restype = None
    lib.gguf_blocks_to_fp32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                        ctypes.c_void_p, ctypes.c_int]
    lib.transpose_fp32.restype = None
    lib.transpose_fp32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int]
    lib.fp32_pack_panels.restype = None
    lib.fp32_pack_panels.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_int]
    lib.fp32_pack_panels_in_place.restype = None
    lib.fp32_pack_panels_in_place.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int]
    lib.fp32_panel_matmul.restype = None
    lib.fp32_panel_matmul.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_int]
    lib.decode_step.restype = ctypes.c_int
    lib.head_step.restype = ctypes.c_int
    lib.q4_kernel_isa.restype = ctypes.c_int
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float] + [ctypes.c_void_p] * 3 \
        + [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2 \
        + [ctypes.c_int]
    return lib


def library(isa: str = "native") -> ctypes.CDLL | None:
    """The built library (None without a compiler or with FMSERVE_NO_C_KERNEL set)."""
    return _library(isa)


def kernel_isa(isa: str = "native") -> str:
    """Which dot-product loop the library runs: "avx512-vnni", "avx2" or "c"."""
    return ("c", "avx2", "avx512-vnni")[_library(isa).q4_kernel_isa()]


def available() -> bool:
    return _library() is not None
