"""Time an fp32 engine's dense projections on the C kernel's panels against torch.mm, in one
process, rounds alternated: first the model's projections alone at several row counts, then
greedy decoding of dev prompts at 1 and 8 streams with two engines, one built each way.

    python scripts/bench_dense_fp32.py [--model PATH] [--tokens 48] [--rounds 2] [--compile on]

Prints ms and the ratio (torch / panels) for each, and whether the two engines gave the same
tokens (the sums' order differs: a near tie may go the other way). docs/benchmarks.md, "Dense
fp32 projections in C".
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fmserve.bench import DEV_PROMPTS  # noqa: E402
from fmserve.default_model import default_model_path  # noqa: E402
from fmserve.engine import Engine  # noqa: E402
from fmserve.jsonl import read_prompts  # noqa: E402
from gpu import layers  # noqa: E402
from ipc.sampling import SamplingParams  # noqa: E402


def engine(model: str, panels: bool, compile_mode: str) -> Engine:
    keep = layers.pack_panels
    if not panels:
        # this engine's DenseLinears keep W^T / W, as without the library
        layers.pack_panels = lambda weight, in_place=False: None
    try:
        return Engine(model=model, device="cpu", dtype="fp32", max_kv_tokens=4096,
                      max_running_requests=8, progress=False, compile=compile_mode)
    finally:
        layers.pack_panels = keep


def projections(e: Engine) -> list:
    model = e.worker.state.model
    return [getattr(layer, n) for layer in model.layers
            for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]


def best_of(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", default="off", choices=("off", "on"),
                    help="runtime.compile of both engines (off: the kernels alone, eagerly)")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    engines = {way: engine(model, way == "panels", args.compile) for way in ("torch", "panels")}
    print(f"torch threads {torch.get_num_threads()}")
    lins = {way: projections(e) for way, e in engines.items()}
    for rows in (1, 2, 4, 8, 16, 64):
        xs = [torch.randn(rows, lin.in_features) for lin in lins["torch"]]
        t = {way: best_of(lambda: [lin(x) for lin, x in zip(ls, xs)]) for way, ls in lins.items()}
        print(f"projections, {rows:3d} rows: torch {1e3 * t['torch']:7.1f} ms  panels "
              f"{1e3 * t['panels']:7.1f} ms  {t['torch'] / t['panels']:.2f}x")
    texts = list(itertools.islice(read_prompts(str(DEV_PROMPTS)), 8))
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
    for streams in (1, 8):
        prompts = [[engines["torch"].encode(t)] for t in texts] if streams == 1 else \
            [[engines["torch"].encode(t) for t in texts]]
        total = {way: 0.0 for way in engines}
        tokens = {way: [] for way in engines}
        for rnd in range(args.rounds):
            for batch in prompts:
                for way in (list(engines) if rnd % 2 == 0 else list(engines)[::-1]):
                    start = time.perf_counter()
                    out = engines[way].generate(batch, params)
                    total[way] += time.perf_counter() - start
                    if rnd == 0:
                        tokens[way] += [o.token_ids for o in out]
        made = args.rounds * len(texts) * args.tokens
        same = sum(a == b for a, b in zip(tokens["torch"], tokens["panels"]))
        print(f"decode, {streams} stream(s): torch {made / total['torch']:6.1f} tok/s  panels "
              f"{made / total['panels']:6.1f} tok/s  {total['torch'] / total['panels']:.2f}x; "
              f"same tokens in {same} of {len(texts)} prompts")


if __name__ == "__main__":
    main()
