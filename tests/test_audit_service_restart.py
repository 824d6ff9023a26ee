"""A service killed and started again on the same endpoint while a client waits: the client's
requests in flight were lost with the old service, and the client must say so, not wait."""

from __future__ import annotations

import os
import signal
import threading
import time

import tests.test_service as ts
from ipc.client import Client
from ipc.client_errors import ClientError, ServiceUnavailable
from ipc.sampling import SamplingParams


def test_requests_in_flight_fail_when_the_service_restarts(model_path, monkeypatch):
    first = ts.ServiceProcess(model_path)
    second = None
    outcome: list[object] = []
    try:
        client = Client(first.endpoint)
        params = SamplingParams(temperature=0.0, max_new_tokens=5000, ignore_eos=True)

        def run() -> None:
            try:
                # timeout_s only so that the test ends when it fails: the new service answers
                # every ping, so without it the request waited forever.
                outcome.append(client.complete("Tell me a story", params=params, timeout_s=15.0))
            except ClientError as exc:
                outcome.append(exc)

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 30
        while client.health().running < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        worker = first.worker_pid()
        first.proc.kill()  # a crash: no terminal message for anyone
        first.proc.wait()
        os.kill(worker, signal.SIGKILL)
        ports = iter([first.port, first.tport])
        monkeypatch.setattr(ts, "free_port", lambda: next(ports))
        second = ts.ServiceProcess(model_path)  # the same endpoint, a new service
        t.join(timeout=30)
        assert outcome, "the request still waits"
        assert isinstance(outcome[0], ServiceUnavailable), outcome[0]
        assert "restarted" in str(outcome[0])
        # and the same client serves on with the new service
        assert client.complete("Hi", params=SamplingParams(max_new_tokens=2)).token_ids
        client.close()
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.log_text()[-3000:]
