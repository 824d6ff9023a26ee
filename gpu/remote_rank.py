"""A tensor-parallel rank on another machine (parallel.remote_ranks): `fmserve worker --rank R
--world-size N --master-addr A --master-port P`, the variables torchrun sets.

It connects to rank 0's rendezvous store (the service's worker, gpu/tp_ranks.py), reads the
group's WorkerConfig from it (the model path may be overridden: the file's place on this
machine), joins the group and runs every plan rank 0 relays, as a local rank does. When the
group goes down (rank 0 shut it down, died, or another rank died) it builds nothing more of it
and waits for the next rank 0 at the same address: the service restarts its worker, which
opens the store again. Plans and results travel over torch.distributed (gloo on the CPU, NCCL
on CUDA, with gloo for the plans), i.e. TCP between the machines.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import msgspec
import torch.distributed as dist

from gpu.tp_ranks import (COLLECTIVE_TIMEOUT, CONFIG_KEY, FULL_KEY, GROUP_KEY, RankGroup,
                          backend_for, follow)
from ipc.worker_config import WorkerConfig

JOIN_TIMEOUT = timedelta(seconds=20)  # one attempt to reach rank 0; then say so and retry
RETRY_S = 0.5
# After a failed set-up, how long rank 0 has to take a dead group's store down or publish the
# next group before this rank takes the failure for its own.
GROUP_GONE_WAIT_S = 3.0


def say(rank: int, text: str) -> None:
    print(f"fmserve worker rank {rank}: {text}", file=sys.stderr, flush=True)


def group_config(store: dist.TCPStore, model: str | None, threads: int) -> WorkerConfig:
    """The group's WorkerConfig as rank 0 published it, with this machine's model path (if
    given) and thread count (rank 0's is for its own machine)."""
    try:
        cfg = msgspec.json.decode(store.get(CONFIG_KEY), type=WorkerConfig)
    except msgspec.DecodeError as exc:
        raise ValueError(f"rank 0 published a WorkerConfig this fmserve cannot read ({exc}): "
                         f"run the same fmserve version on every machine") from None
    if model:
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=model))
    runtime = msgspec.structs.replace(cfg.runtime, worker_cpu_threads=threads)
    return msgspec.structs.replace(cfg, runtime=runtime, progress=False).validate()


def group_gone(addr: str, port: int, size: int, group: bytes) -> bool:
    """Whether rank 0's group `group` is over, asked after GROUP_GONE_WAIT_S: its store is
    unreachable, or names the next group."""
    time.sleep(GROUP_GONE_WAIT_S)
    try:
        store = dist.TCPStore(addr, port, size, False, timeout=timedelta(seconds=5))
        return store.get(GROUP_KEY) != group
    except dist.DistError:
        return True


def serve_remote_rank(rank: int, size: int, addr: str, port: int, model: str | None = None,
                      threads: int = 0, groups: int = 0) -> int:
    """Join rank 0's groups one after another, `groups` of them (0: for ever)."""
    from gpu.worker import Worker

    if not 0 < rank < size:
        raise ValueError(f"--rank {rank} is not one of 1..{size - 1}: rank 0 is the service's "
                         f"own worker, the others run `fmserve worker`")
    last_group, served, waiting_since = None, 0, time.monotonic()
    while not groups or served < groups:
        try:
            store = dist.TCPStore(addr, port, size, False, timeout=JOIN_TIMEOUT)
            group = store.get(GROUP_KEY)
            # The store of the group that just went down, or of one already complete (a rank
            # of it died and rank 0 has not noticed yet): wait for the next group.
            if group == last_group or (store.check([FULL_KEY]) and store.get(FULL_KEY) == group):
                time.sleep(RETRY_S)
                continue
            cfg = group_config(store, model, threads)
            dist.init_process_group(backend_for(cfg), store=dist.PrefixStore("default_pg", store),
                                    rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        except dist.DistError as exc:  # no rank 0 there (yet), or it went away while joining
            say(rank, f"waiting for rank 0 at {addr}:{port} "
                      f"({time.monotonic() - waiting_since:.0f} s; {type(exc).__name__})")
            time.sleep(RETRY_S)
            continue
        last_group, served = group, served + 1
        say(rank, f"joined group {group.decode()} of {size} ranks ({cfg.model.path})")
        try:
            worker = Worker(cfg)  # a model that cannot load here stops this rank: raised
        except Exception as exc:
            dist.destroy_process_group()
            if not group_gone(addr, port, size, group):
                raise
            # Joined in the moment rank 0 went down (a rank started right after another died
            # joins the dying group): the group's end, not this rank's.
            say(rank, f"the group went down while this rank set up ({type(exc).__name__}: "
                      f"{exc}); waiting for the next")
            waiting_since = time.monotonic()
            continue
        try:
            follow(RankGroup(rank, size, backend_for(cfg)), worker)
            say(rank, "rank 0 shut the group down")
        except Exception as exc:  # noqa: BLE001 - a peer gone: the group is over, not us
            say(rank, f"the group went down ({type(exc).__name__}: {exc}); waiting for the next")
        finally:
            dist.destroy_process_group()
        waiting_since = time.monotonic()
    return 0
