"""One greedy stream offline, plain against EAGLE-3 (the shipped head, a chain), in one run:
decode tok/s and tokens per verify step. The figures in docs/benchmarks.md ("EAGLE's verify
in C") come from:

    python scripts/bench_eagle_stream.py --ways plain,always,auto,plain,always,auto --steps 3
"""

from __future__ import annotations

import argparse
import itertools
import time

from fmserve.bench import DEV_PROMPTS
from fmserve.default_model import default_model_path
from fmserve.engine import Engine
from fmserve.jsonl import read_prompts
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings


def run(way: str, steps: int, tokens: int, prompt_index: int, dtype: str) -> str:
    spec = None if way == "plain" else SpecSettings(
        "eagle3", "", num_steps=steps, topk=1, num_draft_tokens=steps + 1,
        disable_above_batch_size=0 if way == "always" else "auto")
    engine = Engine(model=str(default_model_path()), device="cpu", dtype=dtype,
                    max_kv_tokens=4096, max_running_requests=4, progress=False, spec=spec)
    text = next(itertools.islice(read_prompts(str(DEV_PROMPTS)), prompt_index, None))
    prompt = engine.encode(text)
    engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    start = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=tokens,
                                                   ignore_eos=True))[0]
    seconds = time.perf_counter() - start
    per_step = out.spec_accept_length
    return (f"{way:7s} {tokens / seconds:6.1f} tok/s  tokens per verify step "
            f"{'-' if per_step is None else f'{per_step:.2f}'}  first ids {out.token_ids[:6]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ways", default="plain,always,auto",
                    help="comma-separated, in order: plain, always (drafting at every step), "
                         "auto (spec.disable_above_batch_size = auto)")
    ap.add_argument("--steps", type=int, default=3, help="draft steps (the chain's length)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt-index", type=int, default=3, help="which dev prompt")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    for way in args.ways.split(","):
        print(run(way, args.steps, args.tokens, args.prompt_index, args.dtype), flush=True)


if __name__ == "__main__":
    main()
