"""What each rank of the tensor-parallel tests' runs does, in a process of its own
(torch.multiprocessing spawn, gloo over loopback): tests/gpu/test_tensor_parallel.py's worker
with parallel.tp = 2 (the logits of a prefill and the tokens of a few plans), and
tests/gpu/test_tensor_parallel_eagle.py's offline Engine on rank 0 relaying its plans to the
other ranks as the service's worker does; the results are saved for the test to compare with
one rank's."""

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


class RelayingWorker:
    """Rank 0's worker under an offline Engine: each plan goes to the other ranks before it is
    launched here, as gpu/tp_ranks.py's RelaySocket sends the service's plans."""

    def __init__(self, worker: Worker, ranks) -> None:
        from ipc.zmq_util import SchedulerSideCodec

        self.worker, self.ranks = worker, ranks
        self.encode = SchedulerSideCodec().encode

    def launch(self, plan):
        self.ranks.broadcast(self.encode(plan))
        return self.worker.launch(plan)

    def shutdown(self) -> None:
        from ipc.worker_messages import Shutdown

        self.ranks.broadcast(self.encode(Shutdown()))

    def __getattr__(self, name):  # finish, info, state, step: the worker's own
        return getattr(self.worker, name)


def engine_runs(rank: int, world: int, cfgs: list, prompts: list, params: list,
                overlap: bool) -> list[dict]:
    """Every config in turn, one scheduler on rank 0 (an offline Engine whose plans reach every
    rank), the others following: per config, each request's tokens and speculation counters,
    and what the ranks kept quantized."""
    from fmserve.engine import Engine
    from gpu.tp_ranks import RankGroup, follow

    ranks = RankGroup(rank, world, "gloo")
    out = []
    for cfg in cfgs:
        if rank:
            follow(ranks, Worker(cfg))
            continue
        engine = Engine(config=cfg, overlap=overlap)
        engine.worker = RelayingWorker(engine.worker, ranks)
        try:
            done = engine.generate(prompts, params)
        finally:
            engine.worker.shutdown()
        out.append({"tokens": [c.token_ids for c in done],
                    "verify_steps": sum(c.spec_verify_steps for c in done),
                    "accepted": sum(c.spec_accepted_drafts for c in done),
                    "q4_projections": engine.worker.state.model.q4_projections,
                    "num_layers": engine.info.num_layers})
    return out


def engine_rank_main(rank: int, world: int, port: int, cfgs: list, prompts: list,
                     params: list, overlap: bool, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        runs = engine_runs(rank, world, cfgs, prompts, params, overlap)
        if rank == 0:
            torch.save(runs, Path(out_dir) / "runs.pt")
    finally:
        dist.destroy_process_group()
