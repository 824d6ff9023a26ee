"""What this CPU is and which instruction sets fmserve may use on it (torch-free: the CLI reads
it before torch is imported).

Every choice fmserve makes per CPU (dtype, the C kernels' build and loop, the measured
hand-overs, the EAGLE gate's memory) reads the flags here, so one variable can make a newer
CPU run the paths an older one takes: `FMSERVE_CPU_ISA=avx2` hides AVX-512, AMX and AVX-VNNI,
builds the C kernels without them, and (through `torch_isa_env`, applied by the CLI before
torch loads) caps torch's own kernels at AVX2. It is for measuring the AVX2-only path on a
machine that is not one; the pool's AVX2-only EPYC needs no setting.
"""

from __future__ import annotations

import functools
import os
import platform

ENV_CPU_ISA = "FMSERVE_CPU_ISA"
CPU_ISAS = ("native", "avx2")
# The flags an "avx2" cap hides: anything newer than AVX2 + FMA + F16C.
_NEWER_THAN_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")
# torch's CPU dispatch and oneDNN read these at import.
_TORCH_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def cpu_isa() -> str:
    """The instruction-set cap: "native" (all the CPU has) or "avx2"."""
    isa = os.environ.get(ENV_CPU_ISA, "native").strip().lower() or "native"
    if isa not in CPU_ISAS:
        raise ValueError(f"{ENV_CPU_ISA}={isa!r} is not a CPU instruction-set cap; use one of "
                         f"{', '.join(CPU_ISAS)} (or leave it unset)")
    return isa


@functools.cache
def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:  # the first processor's block names the model and its flags
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:  # not Linux: no flags, so fp32 and the plain-C loop, the safe choices
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    return model, tuple(fields.get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what `platform` knows."""
    return _cpuinfo()[0]


def cpu_flag_list(capped: bool = True) -> tuple[str, ...]:
    """The CPU's feature flags in /proc/cpuinfo's order, less those the cap hides (all of them
    with `capped=False`: what -march=native sees)."""
    flags = _cpuinfo()[1]
    if capped and cpu_isa() == "avx2":
        flags = tuple(f for f in flags if not f.startswith(_NEWER_THAN_AVX2))
    return flags


def torch_isa_env() -> dict[str, str]:
    """The environment that caps torch's kernels as the flags are capped (empty for native)."""
    return dict(_TORCH_AVX2_ENV) if cpu_isa() == "avx2" else {}
