"""parallel.remote_ranks: rank 1 of `fmserve serve --tp 2` runs as `fmserve worker` started on
its own (as on another machine: not a child of the service, reaching rank 0 over TCP). The
group gives one rank's greedy tokens; when rank 0 is killed the service restarts it and the
remote rank joins the new group by itself; when the remote rank dies the group goes down, the
service restarts rank 0, and a new `fmserve worker` joins it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fmserve.engine import Engine
from ipc.client import Client
from tests.e2e.service_process import ROOT, ServiceProcess, assert_idle, free_port
from tests.e2e.test_tensor_parallel import GREEDY, PROMPTS, tp_model  # noqa: F401


def start_remote_rank(port: int, log: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.Popen(
        [sys.executable, "-m", "fmserve.cli", "worker", "--rank", "1", "--world-size", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--threads", "1", *extra],
        cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
        start_new_session=True)


def answered(svc: ServiceProcess, restarts: int, deadline_s: float = 120) -> list[list[int]]:
    """The greedy tokens of every prompt, once the worker is ready after `restarts` restarts."""
    deadline = time.monotonic() + deadline_s
    with Client(svc.endpoint) as client:
        while (client.health().worker_state, client.health().replicas[0].restarts) != (
                "ready", restarts):
            assert time.monotonic() < deadline, client.health()
            time.sleep(0.1)
        return [client.complete(token_ids=p, params=GREEDY, timeout_s=deadline_s).token_ids
                for p in PROMPTS]


def test_a_rank_on_another_machine_serves_and_rejoins_after_either_side_dies(tp_model,
                                                                             tmp_path):
    model, path = tp_model
    expected = [c.token_ids for c in Engine(model=str(path), dtype="fp32", progress=False)
                .generate(PROMPTS, [GREEDY] * len(PROMPTS))]
    port, log = free_port(), tmp_path / "remote-rank.log"
    remote = start_remote_rank(port, log)  # waits for rank 0 to open the rendezvous
    svc = ServiceProcess(path, "--tp", "2", "--set", "parallel.remote_ranks=true",
                         "--set", f"parallel.master_port={port}",
                         "--set", "runtime.worker_cpu_threads=1")
    replacement = None
    try:
        assert answered(svc, 0) == expected
        assert remote.pid not in svc.worker_pids() and remote.poll() is None

        os.kill(svc.worker_pid(), signal.SIGKILL)  # rank 0: the remote rank waits, rejoins
        assert answered(svc, 1) == expected
        assert remote.poll() is None and log.read_text().count("joined group") == 2

        remote.kill()  # the remote rank: rank 0 sees it within a keep-alive and goes down
        remote.wait()
        replacement = start_remote_rank(port, log)
        assert answered(svc, 2) == expected
        with Client(svc.endpoint) as client:
            assert_idle(client)
    finally:
        for proc in (remote, replacement):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        assert svc.stop() == 0, svc.log_text()


def test_fmserve_worker_says_what_it_needs(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "fmserve.cli", "worker", "--rank", "0",
                          "--world-size", "2"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2
    assert "needs --master-addr, --master-port" in out.stderr
    out = subprocess.run([sys.executable, "-m", "fmserve.cli", "worker", "--rank", "0",
                          "--world-size", "2", "--master-addr", "127.0.0.1", "--master-port",
                          "1"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "--rank 0 is not one of 1..1" in out.stderr
