"""The cost of runtime.deterministic: prefill and decode tok/s with it off and on, in one run,
interleaved per batch size (dev prompts of 64 tokens, 32 greedy tokens each). The figures in
docs/benchmarks.md ("Deterministic mode") come from:

    python scripts/bench_deterministic.py --dtype bf16 --batch-sizes 1,16
"""

from __future__ import annotations

import argparse

from fmserve.bench.offline import bench_prompts, measure_fmserve
from fmserve.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=32)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engines = {det: Engine(model=args.model, dtype=args.dtype, deterministic=det,
                           max_running_requests=max(batches), progress=False)
               for det in (False, True)}
    prompts = bench_prompts(engines[False].tokenizer, max(batches), args.prompt_len)
    print(f"| batch | mode | prefill tok/s | decode tok/s |\n|---|---|---|---|")
    for b in batches:
        for det, engine in engines.items():
            prefill, decode = measure_fmserve(engine, prompts[:b], args.decode_len)
            print(f"| {b} | {'deterministic' if det else 'default'} | {prefill:.0f} | "
                  f"{decode:.1f} |", flush=True)


if __name__ == "__main__":
    main()
