"""`fmserve worker`: a tensor-parallel rank on another machine for a service started with
parallel.remote_ranks = true (gpu/remote_rank.py). Flags default to the variables torchrun
sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

import argparse
import os


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value and value.isdigit() else None


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank", type=int, default=_env_int("RANK"),
                   help="this rank, 1..world-size - 1 (rank 0 is the service's worker; $RANK)")
    p.add_argument("--world-size", type=int, default=_env_int("WORLD_SIZE"),
                   help="the group's ranks: the service's parallel.tp ($WORLD_SIZE)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"),
                   help="the service's machine: its parallel.master_addr ($MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=_env_int("MASTER_PORT"),
                   help="its parallel.master_port ($MASTER_PORT)")
    p.add_argument("--model", default=None,
                   help="the model's path on this machine (default: the service's path)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads on this machine (default 0: its cores; the service's "
                        "runtime.worker_cpu_threads is for its own machine)")
    p.add_argument("--groups", type=int, default=0,
                   help="leave after serving this many groups (default 0: for ever, waiting for "
                        "the next rank 0 each time one goes down)")


def run_worker(args: argparse.Namespace) -> int:
    missing = [flag for flag, value in (("--rank", args.rank), ("--world-size", args.world_size),
                                        ("--master-addr", args.master_addr),
                                        ("--master-port", args.master_port)) if value is None]
    if missing:
        raise ValueError(f"fmserve worker needs {', '.join(missing)} (or RANK, WORLD_SIZE, "
                         f"MASTER_ADDR, MASTER_PORT in the environment): the service's "
                         f"parallel.tp, master_addr and master_port, and this rank's number")
    from gpu.remote_rank import serve_remote_rank

    return serve_remote_rank(args.rank, args.world_size, args.master_addr, args.master_port,
                             args.model, args.threads, args.groups)
