"""Spawns one worker process (`python -m gpu.worker_main`), talks to it, notices when it dies.

    worker = WorkerHandle(worker_config(model_path=path, dtype="fp32"))
    info = await worker.start()            # WorkerStartError if it cannot load
    result = await worker.step(plan)       # WorkerDied well within 1 s of a crash
    await worker.stop()

For overlap scheduling, `send_plan` and `next_result` split `step`: several plans may be in flight
and results come back in plan order.

Async with zmq.asyncio (anyio's asyncio backend). The worker is *spawned* by module name with
`sys.executable` (never forked: a fork would share the service's sockets and threads), in a new
session so a Ctrl-C reaches the service first, which decides how the worker ends. Its output
goes to a log in the handle's private temp dir, beside the ipc:// socket; errors of a running
worker quote the log's tail (service/worker_spawn.py starts it; with `standby`, one started
ahead becomes the next worker). A worker that fails to start leaves its log beside that dir
(`fmserve-worker-<pid>-*.log`): the error gives its one-line reason and that path. The worker
exits by itself when this process dies (gpu/worker_main.py). This module must not import `gpu`
or torch: the service never holds device state.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path

import anyio
import msgspec
import zmq
import zmq.asyncio

from ipc.worker_config import WorkerConfig
from ipc.worker_messages import (WORKER_PROTOCOL_VERSION, GroupPlan, GroupResult, Shutdown,
                                 StepPlan, StepResult, WorkerFailed, WorkerInfo, WorkerReady,
                                 WorkerToScheduler, answered_slots, planned_slots)
from ipc.zmq_util import SchedulerSideCodec, configure_socket, ipc_endpoint, make_ipc_dir
from service.worker_spawn import Standby, WorkerSpawnError, describe_returncode, spawn_worker

POLL_INTERVAL_S = 0.05  # how often a wait checks that the process is still alive
FINAL_MESSAGE_GRACE_S = 0.3  # a worker that just exited may still have a WorkerFailed in flight
LOG_TAIL_LINES = 25
# The next standby starts this long after a worker is ready: its imports (~3 s of a core)
# would slow the requests a (re)started worker answers first and its compile.
STANDBY_DELAY_S = 15.0


class WorkerStartError(RuntimeError):
    """The worker process could not load its model or never said it was ready."""


class WorkerDied(RuntimeError):
    """The worker process exited, failed a step or stopped answering while it was needed."""


class _WorkerExited(Exception):
    def __init__(self, returncode: int) -> None:
        self.returncode = returncode


class WorkerHandle:
    """One worker process and its socket. Not for concurrent use by several tasks: one task
    sends plans and reads results (the scheduler loop)."""

    def __init__(self, config: WorkerConfig, ready_timeout_s: float = 300.0,
                 step_timeout_s: float = 300.0, env: dict[str, str] | None = None,
                 standby: bool = False, standby_delay_s: float = STANDBY_DELAY_S) -> None:
        # The worker decodes it back into a WorkerConfig (its load progress bar off: stderr
        # is a log file).
        self.config = msgspec.structs.replace(config, progress=False)
        self.ready_timeout_s = ready_timeout_s
        self.step_timeout_s = step_timeout_s
        self.extra_env = dict(env or {})
        # worker.standby: a process started ahead for the next (re)start (service/worker_spawn.py)
        self.use_standby, self.standby_delay_s = standby, standby_delay_s
        self._standby: Standby | None = None
        self._standby_timer: asyncio.TimerHandle | None = None
        self.info: WorkerInfo | None = None
        self.last_returncode: int | None = None  # of the previous process, after stop()
        self._codec = SchedulerSideCodec()
        self._proc: subprocess.Popen | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._dir: Path | None = None
        self._log_file = None
        self.endpoint: str | None = None
        self._inflight: deque[tuple[int, list[bytes]]] = deque()  # (step id, slots to answer)
        self._dead: str | None = None  # why the current process can no longer be used

    # -- state ------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def standby_pid(self) -> int | None:
        """The process started ahead for the next (re)start, if any."""
        return None if self._standby is None else self._standby.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self._dead is None

    @property
    def returncode(self) -> int | None:
        """The current process's exit status; None while it runs or when there is none."""
        return None if self._proc is None else self._proc.poll()

    @property
    def log_path(self) -> Path | None:
        return None if self._dir is None else self._dir / "worker.log"

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 16384))
            text = f.read().decode("utf-8", errors="replace")
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def _start_failed(self, message: str) -> WorkerStartError:
        """A start-up failure for people: the worker's one-line reason and where its whole log
        is, not the log's tail (a traceback of the worker's own code). The log is copied out of
        the temp dir, which start() removes on the way out."""
        path = self.log_path
        if path is not None and path.exists() and path.stat().st_size > 0:
            try:
                fd, kept = tempfile.mkstemp(prefix=f"fmserve-worker-{self.pid}-", suffix=".log",
                                            dir=self._dir.parent)
                os.close(fd)
                shutil.copyfile(path, kept)
            except OSError:
                pass
            else:
                message += f"\nThe worker's full log, with its traceback, is kept in {kept}"
        return WorkerStartError(message)

    # -- life cycle -------------------------------------------------------------------------

    async def __aenter__(self) -> WorkerHandle:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    async def start(self) -> WorkerInfo:
        """Start the worker (the standby if there is one) and wait until its model is loaded;
        then, with `use_standby`, start the next standby."""
        if self._proc is not None:
            raise RuntimeError(f"worker {self.pid} is already started; use restart()")
        self._dead = None
        self._inflight.clear()
        standby_dir = self._standby.ready_for(self.extra_env) if self._standby else None
        if standby_dir is None and self._standby is not None:
            self._standby.discard()
            self._standby = None
        self._dir = standby_dir or make_ipc_dir("fmserve-worker-")
        try:  # from here on, any failure (or cancellation) must leave no process and no files
            self.endpoint = ipc_endpoint(self._dir, "worker.sock")
            self._ctx = zmq.asyncio.Context()
            self._sock = configure_socket(self._ctx.socket(zmq.PAIR))
            self._sock.bind(self.endpoint)
            args = ["--endpoint", self.endpoint,
                    "--config", msgspec.json.encode(self.config).decode()]
            process = self._standby.take(args) if self._standby is not None else None
            self._standby = None
            try:
                process = process or spawn_worker(self._dir, args, self.extra_env)
            except WorkerSpawnError as exc:
                raise WorkerStartError(str(exc)) from exc
            self._proc, self._log_file = process.proc, process.log_file
            self.info = await self._await_ready()
        except BaseException:
            self._kill_and_cleanup()
            raise
        if self.use_standby:
            self._standby_timer = asyncio.get_running_loop().call_later(
                self.standby_delay_s, self._start_standby)
        return self.info

    def _start_standby(self) -> None:
        self._standby_timer = None
        if self._proc is None or self._standby is not None:
            return
        try:
            self._standby = Standby(self.extra_env)
        except WorkerSpawnError:
            pass  # the next restart spawns a fresh worker

    async def _await_ready(self) -> WorkerInfo:
        model = self.config.model.path
        what = f"the worker for {model!r} (pid {self.pid})"
        try:
            msg = await self._receive(self.ready_timeout_s)
        except _WorkerExited as e:
            last = self.log_tail(1)
            raise self._start_failed(
                f"{what} exited with {describe_returncode(e.returncode)} before it was ready"
                + (f"; the last line of its log: {last}" if last else "")) from None
        except TimeoutError:
            raise self._start_failed(
                f"{what} was not ready after {self.ready_timeout_s:g} s (ready_timeout_s); "
                f"it was killed") from None
        except WorkerDied as e:  # it sent something undecodable
            raise WorkerStartError(f"{what}: {e}") from None
        if isinstance(msg, WorkerFailed):
            raise self._start_failed(f"{what} failed to start: {msg.message}")
        if not isinstance(msg, WorkerReady):
            raise WorkerStartError(f"{what} sent {type(msg).__name__} before WorkerReady")
        if msg.info.protocol_version != WORKER_PROTOCOL_VERSION:
            raise WorkerStartError(
                f"{what} speaks worker protocol {msg.info.protocol_version}, this service "
                f"{WORKER_PROTOCOL_VERSION}: the service and the worker come from different "
                f"fmserve versions; reinstall so both match")
        return msg.info

    async def stop(self, timeout_s: float = 5.0, keep_standby: bool = False) -> None:
        """Ask the worker to exit (Shutdown), then SIGTERM, then SIGKILL; remove the temp dir
        (and the standby, unless `keep_standby`: a restart). Safe to call on a handle that is
        stopped, never started or already dead."""
        if self._standby_timer is not None:
            self._standby_timer.cancel()
            self._standby_timer = None
        if not keep_standby and self._standby is not None:
            self._standby.discard()
            self._standby = None
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                await self._sock.send(self._codec.encode(Shutdown()), flags=zmq.DONTWAIT)
            except zmq.ZMQError:
                pass  # no peer any more: the signals below will do
            for sig, wait_s in ((None, timeout_s), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    self._signal_group(sig)
                if await self._wait_exit(wait_s):
                    break
        self._kill_and_cleanup()

    async def restart(self) -> WorkerInfo:
        """Replace the worker (dead or alive) with a fresh process: new socket, new temp dir."""
        await self.stop(timeout_s=2.0, keep_standby=True)
        return await self.start()

    def __del__(self) -> None:
        # A handle dropped without stop(): its worker would wait for plans forever.
        try:
            if getattr(self, "_standby", None) is not None:
                self._standby.discard()
            if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
                self._signal_group(signal.SIGKILL)
            if getattr(self, "_dir", None) is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
        except Exception:  # interpreter shutdown: modules may already be torn down
            pass

    async def _wait_exit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._proc.poll() is None:
            if time.monotonic() >= deadline:
                return False
            await anyio.sleep(0.02)
        return True

    def _signal_group(self, sig: signal.Signals) -> None:
        """Signal the worker's whole process group (its own session): helpers it may have
        started go too. Only while the worker is unreaped, so its pid cannot be reused."""
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            self._proc.send_signal(sig)

    def _kill_and_cleanup(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._signal_group(signal.SIGKILL)
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:  # unkillable (e.g. stuck in the driver)
                    pass
            self.last_returncode = self._proc.returncode
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._log_file is not None:
            self._log_file.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._proc = self._sock = self._ctx = self._log_file = self._dir = None
        self.endpoint = self.info = None
        self._inflight.clear()

    # -- steps ------------------------------------------------------------------------------

    async def step(self, plan: StepPlan) -> StepResult:
        """Run one plan and return its result (no other plan may be in flight)."""
        if self._inflight:
            raise RuntimeError(f"step() with {len(self._inflight)} plans in flight; "
                               f"collect them with next_result() first")
        await self.send_plan(plan)
        return await self.next_result()

    async def send_plan(self, plan: StepPlan | GroupPlan) -> None:
        """Queue a plan (a GroupPlan with DP attention) without waiting for its result."""
        self._check_usable()
        try:
            await self._sock.send(self._codec.encode(plan), flags=zmq.DONTWAIT)
        except zmq.Again:  # the peer is gone (or hopelessly behind)
            raise self._died(f"the worker (pid {self.pid}) does not accept plans "
                             f"(step {plan.step_id})") from None
        self._inflight.append((plan.step_id, planned_slots(plan)))

    async def next_result(self) -> StepResult | GroupResult:
        """The result of the oldest plan in flight. Raises WorkerDied promptly if the process
        exits, reports a failure, or exceeds step_timeout_s (then it is killed)."""
        self._check_usable()
        if not self._inflight:
            raise RuntimeError("next_result() with no plan in flight")
        step_id, slots = self._inflight[0]
        try:
            msg = await self._receive(self.step_timeout_s)
        except _WorkerExited as e:
            raise self._died(f"the worker (pid {self.pid}) exited with "
                             f"{describe_returncode(e.returncode)} during step {step_id}") from None
        except TimeoutError:
            self._signal_group(signal.SIGKILL)
            raise self._died(f"step {step_id} took longer than {self.step_timeout_s:g} s "
                             f"(step_timeout_s); the worker (pid {self.pid}) was killed") from None
        if isinstance(msg, WorkerFailed):
            raise self._died(msg.message)
        if not isinstance(msg, StepResult | GroupResult) or msg.step_id != step_id or \
                answered_slots(msg) != slots:  # a request left out would wait forever
            got = (f"{type(msg).__name__} {getattr(msg, 'step_id', '')}".rstrip()
                   + (" for other requests" if getattr(msg, "step_id", None) == step_id else ""))
            self._signal_group(signal.SIGKILL)
            raise self._died(f"protocol error: expected the result of step {step_id}, "
                             f"the worker sent {got}; it was killed")
        self._inflight.popleft()
        return msg

    def _check_usable(self) -> None:
        if self._proc is None:
            raise WorkerDied("the worker is not started; call start()")
        if self._dead is not None:
            raise WorkerDied(f"the worker is unusable ({self._dead}); call restart()")

    def _died(self, message: str) -> WorkerDied:
        self._dead = message
        self._inflight.clear()
        tail = self.log_tail()
        return WorkerDied(f"{message}\n--- last lines of the worker log ---\n{tail}" if tail
                          else message)

    async def _receive(self, timeout_s: float) -> WorkerToScheduler:
        """The next message. Checks between short polls that the process lives, so a death is
        seen within POLL_INTERVAL_S, not at the timeout."""
        try:  # one already here (the service the slower side) skips the poll's timer and future
            return self._decode(await self._sock.recv(flags=zmq.NOBLOCK))
        except zmq.Again:
            pass
        deadline = time.monotonic() + timeout_s
        poll_ms = int(POLL_INTERVAL_S * 1000)
        while True:
            if await self._sock.poll(timeout=poll_ms, flags=zmq.POLLIN):
                return self._decode(await self._sock.recv())
            if self._proc.poll() is not None:
                # A worker that failed sends WorkerFailed and then exits: read it if it's coming.
                if await self._sock.poll(timeout=int(FINAL_MESSAGE_GRACE_S * 1000),
                                         flags=zmq.POLLIN):
                    return self._decode(await self._sock.recv())
                raise _WorkerExited(self._proc.returncode)
            if time.monotonic() >= deadline:
                raise TimeoutError

    def _decode(self, data: bytes) -> WorkerToScheduler:
        try:
            return self._codec.decode(data)
        except msgspec.DecodeError as exc:
            self._signal_group(signal.SIGKILL)
            raise self._died(f"protocol error: the worker (pid {self.pid}) sent a message this "
                             f"service cannot decode ({exc}); it was killed") from None

