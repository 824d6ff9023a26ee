"""The "auto" gate's measurements kept between runs (gpu/eagle/spec_gate.py).

A gate learns per batch size class whether drafting pays, and learning costs: each class tries
drafting and plain steps, and at 8 streams on 2 cores a drafting trial costs about three plain
steps while the requests admitted meanwhile carry the head. A restarted service (a bench round,
a redeploy) would pay that again for a verdict that depends only on the machine, the model,
the head and the settings. So the classes that measured both ways are kept in
spec_gate.json in the cache directory under that key, and a new gate starts from them
(weighted as a few steps, so this run's own measurements soon decide).

    FMSERVE_GATE_CACHE   "off": keep and read nothing (the test suite: each gate starts empty,
                         and short runs on a busy machine must not teach a real service);
                         else the file to use instead of spec_gate.json in the cache directory
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import msgspec
import torch

from gpu.cpu_kernels import machine_key
from gpu.c_library import build_key
from gpu.eagle.spec_gate import SizeClass, SpecGate
from gpu.worker_state import WorkerState
from ipc.cache_dirs import model_cache_dir

log = logging.getLogger(__name__)

ENV_GATE_CACHE = "FMSERVE_GATE_CACHE"
SAVE_EVERY = 256  # decode steps between two saves, besides a save whenever a verdict changes
_Saved = dict[str, dict[int, SizeClass]]


def _run_key(state: WorkerState) -> str:
    """The machine, the model file, the head, the settings and the C kernels' sources (a
    faster plain step moves the break-even) a step's speed depends on."""
    cfg, spec = state.cfg, state.cfg.spec
    model = Path(cfg.model.path)
    size = model.stat().st_size if model.is_file() else 0
    # On a GPU the step's speed is the card's, and graphs change it; on the CPU, the host's.
    device = (torch.cuda.get_device_name(state.device) if state.device.type == "cuda"
              else state.device.type)
    raw = "|".join(map(str, (
        machine_key(), build_key(), device, cfg.runtime.cuda_graph_max_batch, model.resolve(), size,
        state.dtype, spec.algorithm, spec.draft_model, spec.num_steps, spec.topk,
        spec.num_draft_tokens, cfg.runtime.attention_backend,
        cfg.runtime.q4_max_tokens, cfg.runtime.cpu_fp32_weights, cfg.runtime.kv_cache_dtype,
        cfg.runtime.compile, cfg.weight_quant)))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


class GateMemory:
    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self.steps = 0
        self.verdicts: dict[int, bool] = {}

    @classmethod
    def for_worker(cls, state: WorkerState) -> "GateMemory | None":
        """None where FMSERVE_GATE_CACHE is "off"."""
        where = os.environ.get(ENV_GATE_CACHE, "")
        if where.lower() == "off":
            return None
        path = Path(where).expanduser() if where else model_cache_dir() / "spec_gate.json"
        return cls(path, _run_key(state))

    def _read(self) -> _Saved:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=_Saved)
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError) as exc:  # rewritten whole at the next save
            log.warning("ignoring the EAGLE gate's kept measurements in %s (%s): this run "
                        "measures afresh", self.path, exc)
            return {}

    def restore(self, gate: SpecGate) -> None:
        kept = self._read().get(self.key, {})
        gate.restore(kept)
        self.verdicts = self._verdicts(gate)
        if kept:
            log.info("EAGLE gate: starting from earlier measurements (%s; drafting faster: "
                     "%s)", self.path, self.verdicts)

    @staticmethod
    def _verdicts(gate: SpecGate) -> dict[int, bool]:
        return {k: c.drafting.seconds_per_token <= c.plain_cost()
                for k, c in gate.decided().items()}

    def after_step(self, gate: SpecGate) -> None:
        """Save when a class's verdict is new or changed, and every SAVE_EVERY steps."""
        self.steps += 1
        verdicts = self._verdicts(gate)
        if verdicts and (verdicts != self.verdicts or self.steps % SAVE_EVERY == 0):
            self.verdicts = verdicts
            self._write(gate.decided())

    def _write(self, classes: dict[int, SizeClass]) -> None:
        saved = self._read()
        saved[self.key] = classes
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:  # whole or not at all: another worker may read it meanwhile
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(msgspec.json.encode(saved))
            tmp.replace(self.path)
        except OSError as exc:  # a read-only cache costs the learning per start, nothing else
            log.warning("could not keep the EAGLE gate's measurements in %s: %s", self.path, exc)
