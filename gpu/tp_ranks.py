"""The ranks of a tensor-parallel worker (parallel.tp = N > 1) over torch.distributed.

Rank 0 is the worker process the service spawned (gpu/worker_main.py), the only one with a
socket to the service. It starts ranks 1..N-1 on this machine as child processes
(`python -m gpu.worker_main --rank R --world-size N --master-addr A --master-port P`, with
MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE in their environment too: what torchrun sets),
after opening the group's TCPStore on a free port, then all join one process group: gloo on
the CPU, NCCL on CUDA (with a gloo group beside it for the plans, which live on the host).

Every message rank 0 takes from the service (StepPlan, Shutdown) is broadcast to the others
as it arrives (`RelaySocket`: its length, then its msgpack bytes as a uint8 tensor); each rank
runs the same step on its own FutureMap and samples the same tokens from the all-gathered
logits (gpu/tensor_parallel.py), and rank 0 alone sends the StepResult. While no plan comes,
rank 0 broadcasts an empty keep-alive every KEEPALIVE_S, below the group's collective timeout,
and checks its ranks every poll: one that died takes the whole group down (rank 0 reports
it and exits; the service restarts the worker, which starts its ranks afresh). A rank exits
when rank 0 (its parent) is gone, by the parent watch every worker process runs.
"""

from __future__ import annotations

import datetime
import os
import secrets
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

from gpu.device import resolve_device
from ipc.process_heap import release_library_pages
from ipc.worker_config import WorkerConfig

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
KEEPALIVE_S = 60.0  # well below COLLECTIVE_TIMEOUT: idle ranks wait in a broadcast
# Ranks on other machines cannot be watched as child processes: a keep-alive this often is
# what finds one that died while the group idles.
REMOTE_KEEPALIVE_S = 1.0
CONFIG_KEY, GROUP_KEY = "fmserve/config", "fmserve/group"  # rank 0's store, for remote ranks
FULL_KEY = "fmserve/full"  # the group token again once every rank has joined
POLL_MS = 50  # how often rank 0, idle, checks that its ranks live
STOP_GRACE_S = 5.0


class RankDied(RuntimeError):
    """A rank of the group exited, or a broadcast to the ranks failed."""


def backend_for(cfg: WorkerConfig) -> str:
    return "nccl" if resolve_device(cfg.model.device).type == "cuda" else "gloo"


class RankGroup:
    """This process's view of the group: rank, size, the gloo group the plans travel on, and
    (rank 0) the processes of the other ranks."""

    def __init__(self, rank: int, size: int, backend: str,
                 followers: list[subprocess.Popen] | None = None) -> None:
        self.rank, self.size = rank, size
        self.followers = followers or []  # empty for ranks on other machines
        self.keepalive_s = KEEPALIVE_S  # rank 0: how often an idle group hears from it
        # Plans are bytes on the host: over NCCL they take a gloo group of the same ranks.
        self.relay_group = dist.new_group(backend="gloo") if backend == "nccl" else None

    def broadcast(self, data: bytes | None = None) -> bytes:
        """Rank 0 sends `data` (b"": a keep-alive); the others receive it."""
        length = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(length, 0, group=self.relay_group)
        n = int(length.item())
        if n == 0:
            return b""
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
               else torch.empty(n, dtype=torch.uint8))
        dist.broadcast(buf, 0, group=self.relay_group)
        return data if self.rank == 0 else buf.numpy().tobytes()

    def dead_follower(self, wait_s: float = 0.0) -> str | None:
        """Which rank exited, if one did; `wait_s`: look again for that long (a killed rank's
        sockets close, failing our collective, a moment before its exit can be seen)."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, proc in enumerate(self.followers, start=1):
                if proc.poll() is not None:
                    return (f"tensor-parallel rank {r} (pid {proc.pid}) exited with code "
                            f"{proc.returncode}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Rank 0, leaving: wait for the ranks (they exit on the Shutdown they were sent, or as
        their parent goes), then kill what is left; leave the group."""
        deadline = time.monotonic() + grace_s
        for proc in self.followers:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def publish_group(store: dist.TCPStore, config_json: str) -> None:
    """What a rank on another machine reads from rank 0's store before it joins
    (gpu/remote_rank.py): the group's WorkerConfig, and a token naming this group (a rank
    back from a group that went down waits for a new one, not the old store still up)."""
    store.set(CONFIG_KEY, config_json)
    store.set(GROUP_KEY, secrets.token_hex(8))


def mark_group_full(store: dist.TCPStore) -> None:
    """Every rank has joined: a rank that reaches this store now (one started right after a
    rank of this group died, before rank 0 noticed) must wait for the next group, not try to
    join this one, which would wait for a rank 0 that never answers."""
    store.set(FULL_KEY, store.get(GROUP_KEY))


def start_ranks(cfg: WorkerConfig, config_json: str) -> RankGroup:
    """Rank 0: open the rendezvous store, start ranks 1..N-1 on this machine (or, with
    parallel.remote_ranks, publish the config for the `fmserve worker`s elsewhere and wait
    for them), join the group."""
    size, backend, addr = cfg.parallel.tp, backend_for(cfg), cfg.parallel.master_addr
    store = dist.TCPStore(addr, cfg.parallel.master_port, size, True,
                          timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    followers = []
    if cfg.parallel.remote_ranks:
        publish_group(store, config_json)
        print(f"fmserve worker {os.getpid()}: waiting for tensor-parallel ranks 1..{size - 1} "
              f"(`fmserve worker --rank R --world-size {size} --master-addr {addr} "
              f"--master-port {store.port}` on their machines)", file=sys.stderr, flush=True)
    for rank in range(1, size) if not cfg.parallel.remote_ranks else ():
        env = {**os.environ, "MASTER_ADDR": addr, "MASTER_PORT": str(store.port),
               "RANK": str(rank), "WORLD_SIZE": str(size)}
        followers.append(subprocess.Popen(
            [sys.executable, "-m", "gpu.worker_main", "--rank", str(rank), "--world-size",
             str(size), "--master-addr", addr, "--master-port", str(store.port),
             "--config", config_json, "--parent-pid", str(os.getpid())],
            stdin=subprocess.DEVNULL, env=env, close_fds=True))  # output: rank 0's log
    # As init_method="env://" would: the default group's keys under its prefix.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=0,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    if cfg.parallel.remote_ranks:
        mark_group_full(store)
    group = RankGroup(0, size, backend, followers)
    group.keepalive_s = REMOTE_KEEPALIVE_S if cfg.parallel.remote_ranks else KEEPALIVE_S
    return group


def join_ranks(cfg: WorkerConfig, rank: int, size: int, addr: str, port: int) -> RankGroup:
    """Ranks 1..N-1: join rank 0's group."""
    backend = backend_for(cfg)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return RankGroup(rank, size, backend)


class RelaySocket:
    """Rank 0's socket to the service, relaying every message it receives to the other ranks
    (gpu/worker_main.py's loop reads it as it reads the plain socket)."""

    def __init__(self, sock, ranks: RankGroup) -> None:
        self.sock, self.ranks = sock, ranks

    def recv(self) -> bytes:
        last = time.monotonic()
        while not self.sock.poll(POLL_MS):
            if (dead := self.ranks.dead_follower()) is not None:
                raise RankDied(dead)
            if time.monotonic() - last >= self.ranks.keepalive_s:
                self._relay(b"")
                last = time.monotonic()
        data = self.sock.recv()
        self._relay(data)
        return data

    def _relay(self, data: bytes) -> None:
        try:
            self.ranks.broadcast(data)
        except Exception as exc:  # a peer gone mid-broadcast
            raise RankDied(self.ranks.dead_follower(wait_s=0.5) or f"relaying a plan to the "
                           f"tensor-parallel ranks failed: {exc}") from exc

    def __getattr__(self, name):  # poll, send, setsockopt: the socket's own
        return getattr(self.sock, name)


def follow_plans(cfg: WorkerConfig, rank: int, size: int, addr: str, port: int) -> int:
    """Ranks 1..N-1: build this rank's worker, then run every relayed plan until Shutdown.
    Results stay here (rank 0 sends them). Returns the exit code."""
    from gpu.worker import Worker

    try:
        ranks = join_ranks(cfg, rank, size, addr, port)
        worker = Worker(cfg)
        release_library_pages()  # torch's start-up code leaves the resident set, as rank 0's
        follow(ranks, worker)
        dist.destroy_process_group()
        return 0
    except Exception:
        traceback.print_exc()
        print(f"fmserve worker rank {rank}: failed; the group goes down with it",
              file=sys.stderr, flush=True)
        return 1


def follow(ranks: RankGroup, worker) -> None:
    """Ranks 1..N-1: run every plan rank 0 relays on this rank's worker, until Shutdown."""
    from gpu.group_step import follow_group_plan
    from ipc.worker_messages import GroupPlan, Shutdown, StepPlan
    from ipc.zmq_util import WorkerSideCodec

    codec = WorkerSideCodec()
    while True:
        data = ranks.broadcast()
        if not data:
            continue  # keep-alive
        msg = codec.decode(data)
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, StepPlan):
            worker.finish(worker.launch(msg))
        elif isinstance(msg, GroupPlan):  # DP attention: this rank's plan of the step
            follow_group_plan(ranks, worker, msg)
