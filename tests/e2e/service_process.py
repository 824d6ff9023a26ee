"""A real `fmserve serve` process on free ports, for the tests that run the service across
processes (tests/service/test_server.py, tests/e2e/, the TUI's live test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ipc.client import Client
from ipc.client_errors import ServiceUnavailable
from ipc.client_messages import Stats
from ipc.curve import CurveClient
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
# Clients silent this long lose their requests (service.client_timeout_s; 10 by default). Short,
# so that a vanished client is seen within a test, but three heartbeats (2 s apart): at 3 s, a
# client thread held up for over a second on a loaded 2-core machine lost its requests (the
# TUI's live test).
CLIENT_TIMEOUT_S = 6.0



def child_pids(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


class ServiceProcess:
    def __init__(self, model_path: Path, *extra: str, curve: CurveClient | None = None,
                 bind_host: str = "127.0.0.1") -> None:
        """`extra`: more `fmserve serve` flags; `curve`: the client keys, for a CURVE service;
        `bind_host`: where it binds (clients connect over loopback either way)."""
        self.curve = curve
        for attempt in range(3):  # a free port can be taken by another test before it binds
            try:
                self._start(model_path, extra, bind_host)
                return
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise

    def _start(self, model_path: Path, extra: tuple[str, ...], bind_host: str) -> None:
        self.port, self.tport, self.http_port = free_port(), free_port(), free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"fmserve-svc-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fmserve.cli", "serve", "--model", str(model_path),
             "--dtype", "fp32", "--endpoint", f"tcp://{bind_host}:{self.port}",
             "--telemetry-endpoint", f"tcp://{bind_host}:{self.tport}", "--max-kv-tokens", "4096",
             "--http-port", str(self.http_port),
             "--max-running-requests", "8",
             "--set", f"service.client_timeout_s={CLIENT_TIMEOUT_S}", *extra],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        with Client(self.endpoint, curve=self.curve) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"fmserve serve exited early:\n{self.log_text()}")
                try:
                    c.health(timeout_s=1.0)
                    return
                except ServiceUnavailable:
                    if time.monotonic() > deadline:
                        raise

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def worker_pids(self) -> list[int]:
        """The service's worker processes: its children but a standby (worker.standby)."""
        kids = child_pids(self.proc.pid)  # before the health: a standby started later is not
        with Client(self.endpoint, curve=self.curve) as client:
            standby = {r.standby_pid for r in client.health().replicas}
        return [pid for pid in kids if pid not in standby]

    def worker_pid(self) -> int:
        kids = self.worker_pids()
        assert kids, "the service has no worker child process"
        return kids[0]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        return self.proc.returncode


def assert_idle(client: Client, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = client.health()
        if (s.free_pages, s.free_slots, s.running, s.waiting) == (s.total_pages, s.total_slots, 0, 0):
            return
        assert time.monotonic() < deadline, f"accounting did not return to idle: {s}"
        time.sleep(0.1)


def engine_greedy(model_path, questions: list[str], params) -> list:
    """Completions of the offline engine (one worker in this process, one torch thread) for
    one-message chats: the independent side of a served-output comparison."""
    import torch

    from fmserve.engine import Engine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(model=str(model_path), dtype="fp32", max_kv_tokens=4096,
                        max_running_requests=8, progress=False)
        return engine.generate([[{"role": "user", "content": q}] for q in questions], params)
    finally:
        torch.set_num_threads(threads)


def wait_for_stats(client: Client, cond, what: str, timeout_s: float = 120.0) -> Stats:
    """The service's health once `cond` holds for it; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not cond(stats := client.health()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {stats}"
        time.sleep(0.02)
    return stats
