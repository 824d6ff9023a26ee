"""What each rank of tests/gpu/test_tensor_parallel.py's two-rank runs does, in a process of
its own (torch.multiprocessing spawn, gloo over loopback): a worker with parallel.tp = 2, the
logits of a prefill and the tokens of a few plans, saved for the test to compare with one
rank's."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from gpu.worker import Worker
from ipc.worker_config import worker_config
from ipc.worker_messages import unpack_i32

TINY = dict(attention_backend="torch", max_kv_tokens=256, max_running_requests=4,
            worker_cpu_threads=1)


def last_token_logits(worker: Worker, plan) -> torch.Tensor:
    """The logits of a prefill plan's sampling rows (no sampling, no commit)."""
    batch, hidden, rows = worker.step.forward(plan)
    last = torch.cumsum(batch.extend_lens, 0) - 1
    return worker.state.model.logits(hidden[last[rows]])


def run(model: str, dtype: str, plans: list, tp: int = 1) -> dict:
    """Logits of the first plan's sampling rows, then every plan's tokens, on a fresh worker
    each (the caller's rank, or one process at tp = 1)."""
    cfg = worker_config(model_path=model, dtype=dtype, tp=tp, progress=False, **TINY)
    logits = last_token_logits(Worker(cfg), plans[0])
    worker = Worker(cfg)
    tokens = [unpack_i32(worker.run_step(p).token_ids).tolist() for p in plans]
    return {"logits": logits, "tokens": tokens,
            "q4_projections": worker.state.model.q4_projections,
            "kv_heads": worker.state.kv_pool.num_kv_heads}


def rank_main(rank: int, world: int, port: int, model: str, dtype: str, plans: list,
              out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.save(run(model, dtype, plans, tp=world), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
