"""Starting a worker process: spawned at once, or taken from a standby started ahead.

A fresh Python process spends ~1.4-2.5 s importing torch and the worker's modules before it
reads a byte of the model; a restart after a crash paid that every time. With
`worker.standby = true` (off by default) the supervisor keeps one process started ahead
(`python -m gpu.worker_main --standby`) that has done those imports and waits on its stdin;
a (re)start writes the worker's arguments there and the process goes on as a normal worker,
so the restart costs the model load only. The standby lives in its own temp dir, which becomes
the worker's (its log, then the socket); it exits with its parent (--parent-pid) like a worker.
Its cost: one idle process of ~400 MB (private: the imports' heap and relocated library pages)
and the imports' CPU once after each start.

This module must not import `gpu` or torch (see service/worker_supervisor.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ipc.zmq_util import make_ipc_dir

WORKER_MODULE = "gpu.worker_main"


class WorkerSpawnError(RuntimeError):
    """The worker process could not be started at all (no module, no interpreter)."""


def describe_returncode(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class WorkerProcess:
    """A started worker process, its private temp dir and the log file its output goes to."""

    proc: subprocess.Popen
    dir: Path
    log_file: IO[bytes]


def _project_root_for(package: str) -> Path | None:
    """The directory `package` is imported from, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).resolve().parent.parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]).resolve().parent if locations else None


def _launch(directory: Path, args: list[str], extra_env: dict[str, str],
            stdin) -> WorkerProcess:
    """`python -m gpu.worker_main ARGS --parent-pid <us> --cleanup-dir <directory>`, in a new
    session (a Ctrl-C in the terminal reaches the service first), output to the directory's
    worker.log."""
    root = _project_root_for(WORKER_MODULE.split(".")[0])
    if root is None:
        raise WorkerSpawnError(f"cannot find the '{WORKER_MODULE}' module from "
                               f"{sys.executable}: is fmserve installed in this environment?")
    log_file = open(directory / "worker.log", "wb")
    env = {**os.environ, **extra_env, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", WORKER_MODULE, *args,
           "--parent-pid", str(os.getpid()), "--cleanup-dir", str(directory)]
    try:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, close_fds=True)
    except OSError as exc:
        log_file.close()
        raise WorkerSpawnError(f"cannot run {sys.executable} -m {WORKER_MODULE}: {exc}") from exc
    return WorkerProcess(proc, directory, log_file)


def spawn_worker(directory: Path, args: list[str], extra_env: dict[str, str]) -> WorkerProcess:
    """A worker started now in `directory` (the caller's temp dir); `args` are its own
    (endpoint and config)."""
    return _launch(directory, args, extra_env, subprocess.DEVNULL)


class Standby:
    """One worker process started ahead, in its own temp dir, waiting for its arguments."""

    def __init__(self, extra_env: dict[str, str]) -> None:
        self.extra_env = dict(extra_env)
        directory = make_ipc_dir("fmserve-worker-")
        try:
            self._process: WorkerProcess | None = _launch(directory, ["--standby"],
                                                          self.extra_env, subprocess.PIPE)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.proc.pid

    def ready_for(self, extra_env: dict[str, str]) -> Path | None:
        """The standby's temp dir if it can become a worker with this environment (it is
        alive and was started with the same one), else None."""
        process = self._process
        if process is None or process.proc.poll() is not None or extra_env != self.extra_env:
            return None
        return process.dir

    def take(self, args: list[str]) -> WorkerProcess | None:
        """The standby, told to become the worker with `args`. None if it died meanwhile: its
        temp dir stays (the caller, which bound a socket in it, spawns a fresh worker there)."""
        process, self._process = self._process, None
        if process is None:
            return None
        try:
            process.proc.stdin.write((json.dumps(args) + "\n").encode())
            process.proc.stdin.close()
        except OSError:  # it died after ready_for
            _kill(process)
            return None
        return process

    def discard(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            _kill(process)
            shutil.rmtree(process.dir, ignore_errors=True)


def _kill(process: WorkerProcess) -> None:
    if process.proc.poll() is None:
        try:
            os.killpg(process.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            process.proc.kill()
        try:
            process.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        process.proc.stdin.close()
    except (OSError, AttributeError):
        pass
    process.log_file.close()
