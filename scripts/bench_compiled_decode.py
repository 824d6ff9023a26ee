"""The compiled decode step (runtime.compile) against the eager one: start-up (model load, then
the batch-1 bucket's compile) and decode tok/s with it off and on in one engine, interleaved
per round (dev prompts of 64 tokens, 64 greedy tokens each). A first run in a fresh cache dir
measures a cold compile, the next one a warm one:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python scripts/bench_compiled_decode.py   # cold
    python scripts/bench_compiled_decode.py                     # warm: the fmserve cache dir

docs/benchmarks.md ("Compiled decode step") has the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fmserve.bench.offline import bench_prompts, measure_fmserve
from fmserve.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    start = time.perf_counter()
    engine = Engine(model=args.model, device="cpu", dtype=args.dtype, compile="on",
                    max_running_requests=max(batches), progress=False)
    ready_s = time.perf_counter() - start
    step = engine.worker.step
    compiled = step.compiled_decode
    print(f"start-up {ready_s:.1f} s, of which the batch-1 compile {compiled.compile_s[1]:.1f} s "
          f"({torch.get_num_threads()} threads)")
    prompts = bench_prompts(engine.tokenizer, max(batches), args.prompt_len)
    # On a shared machine a round can lose most of its time to other processes: the best
    # round is the one to compare there, the median where the machine is quiet.
    print("| batch | compile | decode tok/s, median | best | ms per step, best | rounds |\n"
          "|---|---|---|---|---|---|")
    for b in batches:
        tps = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                step.compiled_decode = compiled if on else None
                tps[on].append(measure_fmserve(engine, prompts[:b], args.decode_len)[1])
        for on in (False, True):
            med, best = statistics.median(tps[on]), max(tps[on])
            print(f"| {b} | {'on' if on else 'off'} | {med:.1f} | {best:.1f} | "
                  f"{1e3 * b / best:.1f} | {', '.join(f'{t:.1f}' for t in tps[on])} |",
                  flush=True)
        if b > 1:
            size = compiled.bucket(b)
            print(f"(bucket {size} compiled in {compiled.compile_s.get(size, 0):.1f} s)")


if __name__ == "__main__":
    main()
