"""worker.standby (service/worker_spawn.py): a restart takes the process started ahead, which
has torch imported already, and starts the next one; a standby that died is replaced by a
fresh spawn; nothing is left behind after stop()."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import anyio
import pytest

from ipc.worker_config import worker_config
from ipc.worker_messages import unpack_i32
from service.worker_supervisor import WorkerDied, WorkerHandle
from tests.gpu.test_worker_process import (TINY, WORKER_ENV, process_gone, tiny_model,  # noqa: F401
                                           tiny_plans)


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"  # zmq.asyncio needs asyncio


def has_torch_loaded(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


async def wait_for(condition, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await anyio.sleep(0.1)


async def first_tokens(handle: WorkerHandle) -> list[int]:
    plan = tiny_plans()[0]
    return unpack_i32((await handle.step(plan)).token_ids).tolist()


def standby_dir(pid: int) -> Path:
    """The temp dir a standby was started in (its --cleanup-dir)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(args[args.index(b"--cleanup-dir") + 1].decode())


async def started_with_standby(model: str) -> WorkerHandle:
    handle = WorkerHandle(worker_config(model_path=model, **TINY), ready_timeout_s=60,
                          step_timeout_s=60, env=WORKER_ENV, standby=True, standby_delay_s=0.5)
    await handle.start()
    return handle


@pytest.mark.anyio
async def test_a_restart_takes_the_standby_and_starts_the_next(tiny_model):
    handle = await started_with_standby(tiny_model)
    try:
        assert handle.standby_pid is None  # started a little after the worker is ready
        await wait_for(lambda: handle.standby_pid is not None)
        standby = handle.standby_pid
        assert standby is not None and standby != handle.pid
        await wait_for(lambda: has_torch_loaded(standby))  # imports done, waiting on stdin
        expected = await first_tokens(handle)
        os.kill(handle.pid, signal.SIGKILL)
        await wait_for(lambda: not handle.alive or handle.returncode is not None)
        with pytest.raises(WorkerDied):
            await first_tokens(handle)
        await handle.restart()
        assert handle.pid == standby  # the standby became the worker
        assert handle.log_path.parent == standby_dir(standby)
        assert await first_tokens(handle) == expected  # a fresh worker, the same plan
        await wait_for(lambda: handle.standby_pid is not None)
        following = handle.standby_pid
        assert following not in (None, standby)
        following_dir = standby_dir(following)
    finally:
        await handle.stop()
    await wait_for(lambda: process_gone(standby) and process_gone(following), 15)
    assert not following_dir.exists() and handle.standby_pid is None


@pytest.mark.anyio
async def test_a_dead_standby_is_replaced_by_a_fresh_worker(tiny_model):
    handle = await started_with_standby(tiny_model)
    try:
        await wait_for(lambda: handle.standby_pid is not None)
        dead = handle.standby_pid
        os.kill(dead, signal.SIGKILL)
        await wait_for(lambda: process_gone(dead), 15)
        await handle.restart()
        assert handle.alive and handle.pid != dead
        assert len(await first_tokens(handle)) == 2
        await wait_for(lambda: handle.standby_pid is not None)
        assert handle.standby_pid != dead
    finally:
        await handle.stop()
