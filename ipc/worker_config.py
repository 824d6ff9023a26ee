"""The worker's settings, declared once: config.toml's [model], [runtime] and [parallel]
sections are these structs, [spec] is `SpecSettings`, and `WorkerConfig` gathers them for one
worker.

The service builds a WorkerConfig from config.toml (service/config.py), sends it to the worker
process as msgpack (gpu/worker_main.py decodes it), and the offline `Engine` takes one too.
Defaults and ranges live on the fields (msgspec `Meta`), so decoding checks them; a rule tying
two fields together is a method. Adding a setting touches config.toml, a struct here and the
code that reads it.

    cfg = worker_config(model_path="default", dtype="fp32", q4_max_tokens=0)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ipc.spec_settings import SpecSettings

ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: triton on CUDA, torch on a CPU
# The worker's order when plan k+1 is already waiting while step k is launched but not sent:
#   off:     finish and send step k, then prepare and launch k+1
#   prepare: prepare k+1 (bookkeeping and batch, on the schedule stream), send k, launch k+1:
#            the device's gap between the forwards holds only the sending of result k
#   on:      prepare and launch k+1, then send k (the device never waits, but a host-bound
#            launch holds result k back by a whole step)
#   auto:    "on" on GPUs (launching is asynchronous there), "off" on a CPU (there launching
#            *is* computing, so finishing first sends the result sooner)
LaunchAhead = Literal["off", "prepare", "on", "auto"]
# The decode step under torch.compile (gpu/compiled_decode.py): "auto" compiles where it pays
# (a bf16 or fp32 model on the CPU with the torch attention backend), "on" insists (refused
# where it cannot apply), "off" never.
CompileMode = Literal["auto", "on", "off"]

DEFAULT_Q4_MAX_TOKENS = 12  # runtime.q4_max_tokens; 0 turns keeping quantized weights off


class ModelSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """config.toml [model]."""

    path: Annotated[str, Meta(pattern=r"\S", description='must be a .gguf file, a Hugging '
                              'Face model directory or "default"')] = "default"
    device: Annotated[str, Meta(pattern=r"^(auto|cpu|cuda(:\d+)?)\Z",
                                description='must be "auto", "cpu", "cuda" or "cuda:N"')] = "auto"
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"


class RuntimeSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """config.toml [runtime]; config.toml explains each key."""

    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    page_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    max_kv_tokens: Annotated[int, Meta(ge=1, le=1 << 26)] = 65536
    max_running_requests: Annotated[int, Meta(ge=1, le=4096)] = 64
    max_tokens_per_step: Annotated[int, Meta(ge=1, le=1 << 20)] = 2048
    max_context_len: Annotated[int, Meta(ge=0, le=1 << 24)] = 0  # 0: the model's own limit
    wrwr_check: bool = False  # FutureMap write/read checks; FMSERVE_WRWR_CHECK=1 turns it on too
    sync_check: bool = False  # no host sync while launching; FMSERVE_SYNC_CHECK=1 too
    worker_cpu_threads: Annotated[int, Meta(ge=0, le=1024)] = 0  # 0: auto (the service's rule)
    q4_max_tokens: Annotated[int, Meta(ge=0, le=4096)] = DEFAULT_Q4_MAX_TOKENS  # 0: never
    # A CPU without native bf16 (gpu/cpu_kernels.py): "split" keeps only the codes
    cpu_fp32_weights: Literal["dense", "split"] = "split"
    # "auto": fp16 where the model is fp32 on its codes (cpu_fp32_weights), else the model's
    kv_cache_dtype: Literal["auto", "model"] = "auto"
    cuda_graph_max_batch: Annotated[int, Meta(ge=0, le=4096)] = 64  # 0: never; where it applies
    deterministic: bool = False  # batch-invariant forwards (gpu/rowwise_linear.py)
    compile: CompileMode = "auto"  # FMSERVE_COMPILE decides what "auto" means when set


class ParallelSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """config.toml [parallel]: worker ranks over torch.distributed (gpu/tp_ranks.py)."""

    tp: Annotated[int, Meta(ge=1, le=64)] = 1  # tensor-parallel ranks of one worker group
    # Data-parallel replicas: worker groups behind one scheduler (service/replica.py); a
    # worker is one replica and does not read it.
    dp: Annotated[int, Meta(ge=1, le=64)] = 1
    # Ranks 1..tp-1 on other machines: each started there with `fmserve worker --rank R
    # --world-size N --master-addr A --master-port P`; rank 0 (the service's worker) opens the
    # rendezvous at master_addr:master_port and waits for them (gpu/tp_ranks.py).
    remote_ranks: bool = False
    master_addr: str = "127.0.0.1"  # where the other ranks reach rank 0's rendezvous store
    master_port: Annotated[int, Meta(ge=0, le=65535)] = 0  # 0: a free port (local ranks only)
    # DP attention (gpu/dp_attention.py): the tp ranks each hold the whole attention and their
    # own requests; only the MLP is cut across them. Built on the worker side only so far.
    dp_attention: bool = False


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything one worker (or the offline engine's in-process worker) is built from."""

    model: ModelSettings = ModelSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    spec: SpecSettings = SpecSettings()
    parallel: ParallelSettings = ParallelSettings()
    launch_ahead: LaunchAhead = "auto"
    weight_quant: Literal["none", "int8", "fp16"] = "none"  # opt-in compressed dense weights
    progress: bool = True  # a load progress bar (off in a worker process: stderr is a log)

    def validate(self) -> "WorkerConfig":
        """The rules that tie fields together; returns self. Raises ValueError."""
        if self.runtime.max_kv_tokens < self.runtime.page_size:
            raise ValueError(f"runtime.max_kv_tokens = {self.runtime.max_kv_tokens} must be at "
                             f"least runtime.page_size = {self.runtime.page_size} (one page)")
        if self.runtime.deterministic and self.runtime.attention_backend == "triton":
            raise ValueError("runtime.deterministic = true needs runtime.attention_backend = "
                             "\"torch\" or \"auto\" (its batch-invariant attention is written in "
                             "torch)")
        self.spec.validate()
        tp = self.parallel.tp
        if self.parallel.remote_ranks and (tp < 2 or not self.parallel.master_port):
            raise ValueError(f"parallel.remote_ranks = true needs parallel.tp >= 2 (it is {tp}) "
                             f"and a fixed parallel.master_port (it is "
                             f"{self.parallel.master_port}) for the other machines' "
                             f"`fmserve worker --master-port` to reach")
        if self.parallel.dp_attention and tp < 2:
            raise ValueError("parallel.dp_attention = true needs parallel.tp >= 2: the tp ranks "
                             "are the attention's data-parallel ranks and the MLP's "
                             "tensor-parallel ones; set parallel.tp (--tp) to the number of ranks")
        limit = self.spec.disable_above_batch_size
        if self.parallel.dp_attention and self.spec.enabled and limit not in (0, "auto"):
            # Ranks with batches either side of the limit would make different forwards.
            raise ValueError(f"spec.disable_above_batch_size = {limit} with parallel."
                             f"dp_attention = true is not built: each attention rank has a "
                             f"batch of its own, and all must draft or none; set it to 0 or "
                             f"\"auto\" (which always drafts there)")
        return self


_SECTIONS = {"model": ModelSettings, "runtime": RuntimeSettings, "spec": SpecSettings,
             "parallel": ParallelSettings}
_TOP = {f for f in WorkerConfig.__struct_fields__ if f not in _SECTIONS}
# Flat names for the offline engine's keyword arguments: model_path is [model] path.
_ALIASES = {"model_path": ("model", "path")}


def _section_of(name: str) -> tuple[str, str]:
    if name in _ALIASES:
        return _ALIASES[name]
    for section, struct in _SECTIONS.items():
        if name in struct.__struct_fields__ and section != "spec":
            return section, name
    raise TypeError(f"{name!r} is not a worker setting; the settings are: "
                    f"{', '.join(sorted(known_settings()))}")


def known_settings() -> list[str]:
    return ([*_ALIASES] + [f for s in ("model", "runtime", "parallel") for f in
                           _SECTIONS[s].__struct_fields__ if f != "path"] + sorted(_TOP) + ["spec"])


def worker_config(base: WorkerConfig | None = None, **settings: Any) -> WorkerConfig:
    """`base` (default: all defaults) with settings given by their flat names, e.g.
    worker_config(model_path="x.gguf", dtype="fp32", page_size=32, spec=SpecSettings(...)).
    Checked like a decoded config: a value out of range raises msgspec.ValidationError.
    A setting given as None is left as it is (a flag not given)."""
    cfg = msgspec.to_builtins(base or WorkerConfig())
    for name, value in settings.items():
        if value is None:
            continue
        if name in _TOP or name == "spec":
            cfg[name] = msgspec.to_builtins(value)
        else:
            section, key = _section_of(name)
            cfg[section][key] = value
    return msgspec.convert(cfg, WorkerConfig).validate()
