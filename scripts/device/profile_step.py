"""There (a CUDA device): where a decode step spends its time, plain and EAGLE-3.

For each mode: tok/s of PROFILE_BATCH greedy streams (default 1; offline engine, overlap off
and on), then one generation under torch.profiler: the ops by host (self CPU) time and by
device time, and how much of the wall the device was busy. A step whose device time is far
below its wall is bound by the host's launches and bookkeeping, not by the model. With
PROFILE_PY=1, one more generation under cProfile: the Python functions by their own time,
where the host's bookkeeping between the ops shows (the EAGLE service at 8-32 streams on an
H100 idled its worker 13-20% of the time: docs/benchmarks.md).
Usage: [PROFILE_BATCH=8] [PROFILE_PY=1] python3 scripts/device/profile_step.py
       [plain|plain-unfused|eagle3 ...]  (plain-unfused: without gpu/fused_ops.py's kernels)
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fmserve.engine import Engine
from gpu import llama
from gpu.layers import fused_ops_for
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings

CHAT = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
TOKENS = int(os.environ.get("PROFILE_TOKENS", "128"))
BATCH = int(os.environ.get("PROFILE_BATCH", "1"))
CUDA = torch.cuda.is_available()  # without one: a smoke run of this script on the CPU


def tok_s(engine: Engine, overlap: bool) -> float:
    engine.overlap = overlap
    params = SamplingParams(temperature=0.0, max_new_tokens=TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate([CHAT] * BATCH, [params] * BATCH)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def main(modes: list[str]) -> None:
    print(torch.cuda.get_device_name() if CUDA else "cpu", "torch", torch.__version__, flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    for mode in modes:
        spec = (SpecSettings("eagle3", "", num_steps=4, topk=1, num_draft_tokens=5,
                             disable_above_batch_size=0) if mode == "eagle3" else None)
        # "plain-unfused": the decoder's elementwise groups as torch ops, not gpu/fused_ops.py
        llama.fused_ops_for = (lambda device: None) if mode == "plain-unfused" else fused_ops_for
        engine = Engine(progress=False, device="cuda" if CUDA else "cpu",
                        dtype="bf16" if CUDA else "auto",
                        **({"spec": spec} if spec else {}))
        print(f"== {mode}: {engine.worker.fast_paths()}", flush=True)
        for _ in range(2):  # warm-up: graphs, Triton's compiles, caches
            tok_s(engine, False)
        for overlap in (False, True, False, True):
            print(f"{mode} overlap {'on ' if overlap else 'off'}: "
                  f"{tok_s(engine, overlap):.1f} tok/s", flush=True)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            rate = tok_s(engine, True)
            wall = time.perf_counter() - start
        events = prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        print(f"{mode} profiled, {BATCH} stream(s): {rate:.1f} tok/s, wall {wall * 1e3:.0f} ms, "
              f"device busy {device_us / 1e3:.0f} ms ({100 * device_us / 1e6 / wall:.0f}% of the "
              f"wall), {device_us / (TOKENS * BATCH):.0f} us of device time a token")
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        if CUDA:
            print(events.table(sort_by="self_device_time_total", row_limit=12,
                               max_name_column_width=60))
        if os.environ.get("PROFILE_PY") == "1":
            py = cProfile.Profile()
            py.runcall(tok_s, engine, True)
            pstats.Stats(py).sort_stats("tottime").print_stats(25)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["plain", "eagle3"])
