"""The collectives of one tensor-parallel decode step, alone: what `parallel.tp = N` adds to a
step of the default model (30 layers, hidden 576, vocabulary 49152) at a batch of B rows, on
gloo ranks of this machine (one thread each), as gpu/tensor_parallel.py makes them: two
all-reduces of [B, hidden] a layer (o_proj, down_proj), one of the embedding's [B, hidden], one
all-gather of the lm_head's [B, vocab / N] slices.

    python scripts/bench_tp_collectives.py --tp 3 --batch 1,32

docs/benchmarks.md ("Tensor and data parallelism on one CPU") has the figures.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYERS, HIDDEN, VOCAB, STEPS = 30, 576, 49152, 20


def rank_main(rank: int, size: int, port: int, batches: list[int], out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    for batch in batches:
        hidden = torch.randn(batch, HIDDEN)
        part = torch.randn(batch, VOCAB // size)
        parts = [torch.empty_like(part) for _ in range(size)]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(STEPS):
            for _ in range(2 * LAYERS + 1):
                dist.all_reduce(hidden)
            dist.all_gather(parts, part)
        per_step = (time.perf_counter() - start) / STEPS
        if rank == 0:
            out.put((batch, per_step))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--batch", default="1,32")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    port = 29500 + os.getpid() % 1000
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.tp, port, batches, out))
             for r in range(args.tp)]
    for p in procs:
        p.start()
    for _ in batches:
        batch, per_step = out.get(timeout=600)
        print(f"tp {args.tp}, batch {batch}: {per_step * 1e3:.2f} ms of collectives a decode "
              f"step ({2 * LAYERS + 1} all-reduces of [{batch}, {HIDDEN}], one all-gather of "
              f"[{batch}, {VOCAB // args.tp}] x {args.tp})")
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
