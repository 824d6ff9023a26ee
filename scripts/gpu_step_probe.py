"""Per-step cost of the offline engine on a GPU: output tok/s with overlap off and on for each
attention backend (batch 32, 64 greedy tokens, dev prompts), then the host ops that cost most
over a few steps (torch.profiler). The H100 figures in docs/benchmarks.md come from:

    python scripts/gpu_step_probe.py
"""

import json
import time

import torch

from fmserve.bench import DEV_PROMPTS
from fmserve.engine import Engine
from ipc.sampling import SamplingParams


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_step_probe: no CUDA/HIP GPU is visible")
    with open(DEV_PROMPTS, encoding="utf-8") as f:
        questions = [json.loads(line)["prompt"] for line in f][:32]
    chats = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    for backend in ("triton", "torch"):
        engine = Engine(device="cuda", dtype="bf16", attention_backend=backend,
                        max_running_requests=32, progress=False)
        engine.generate(chats, SamplingParams(max_new_tokens=4))  # compile at this batch size
        for overlap in (False, True):
            engine.overlap = overlap
            start = time.perf_counter()
            out = engine.generate(chats, params)
            dt = time.perf_counter() - start
            n = sum(len(c.token_ids) for c in out)
            print(f"{backend} overlap={overlap}: {n / dt:.0f} tok/s, {dt / 64 * 1e3:.1f} ms/step "
                  f"(b32, 64 tokens)", flush=True)
        if backend == "triton":
            from torch.profiler import ProfilerActivity, profile
            engine.overlap = True
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.generate(chats, SamplingParams(temperature=0.0, max_new_tokens=16,
                                                      ignore_eos=True))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22,
                                            max_name_column_width=60))
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
