"""Worker restarts in a real `fmserve serve` process: its worker killed with SIGKILL, also while
a replacement loads (service/worker_recovery.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ipc.client import Client
from ipc.client_errors import RequestFailed
from ipc.sampling import SamplingParams
from tests.e2e.service_process import ServiceProcess, assert_idle, child_pids

SHORT = SamplingParams(temperature=0.0, max_new_tokens=3)


def wait_for_replacement(svc: ServiceProcess, client: Client, old: int) -> int:
    """The pid of the worker started after `old` died, seen while health says restarting."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = client.health()
        new = [p for p in child_pids(svc.proc.pid) if p != old]
        if stats.worker_state == "restarting" and new:
            assert not stats.worker_alive, stats
            return new[0]
        time.sleep(0.02)
    raise AssertionError(f"no replacement worker seen restarting: {client.health()}")


def test_a_worker_killed_while_it_restarts_is_restarted_again_until_restarts_are_spent(
        model_path):
    # Killing the replacement while it loaded used to end the restart for good ("worker down",
    # restarts unused), and every later request got worker_unavailable.
    svc = ServiceProcess(model_path, "--set", "worker.max_restarts=2")
    try:
        with Client(svc.endpoint) as client:
            first = svc.worker_pid()
            os.kill(first, signal.SIGKILL)
            second = wait_for_replacement(svc, client, first)
            os.kill(second, signal.SIGKILL)
            # Sent while the worker restarts: it waits in the queue and runs on the third.
            assert client.health().worker_state == "restarting"
            assert len(client.complete("Hello", params=SHORT, timeout_s=180).token_ids) == 3
            stats = client.health()
            assert (stats.worker_state, stats.worker_alive, stats.worker_restarts) == (
                "ready", True, 2), stats
            assert "worker restart 1 of 2 failed" in svc.log_text()
            assert_idle(client)

            # Both restarts spent: the next death leaves the worker down, and says so.
            os.kill(svc.worker_pid(), signal.SIGKILL)
            deadline = time.monotonic() + 30
            while client.health().worker_state != "down":
                assert time.monotonic() < deadline, client.health()
                time.sleep(0.05)
            assert not client.health().worker_alive
            with pytest.raises(RequestFailed) as failed:
                client.complete("Hello", params=SHORT, timeout_s=30)
            assert failed.value.code == "worker_unavailable"
    finally:
        svc.stop()
