"""A service bound beyond loopback with CURVE keys (`fmserve keys`, service.curve_keys): clients
holding the keys are served on both endpoints; a plain client, or one whose key the service does
not admit, gets no answer at all."""

from __future__ import annotations

import threading
import time

import pytest

from fmserve.cli import main
from ipc.client import Client
from ipc.client_errors import ServiceUnavailable
from ipc.client_messages import Chunk, Finished
from ipc.curve import CLIENTS, curve_client
from ipc.sampling import SamplingParams
from tests.e2e.service_process import ServiceProcess
from tui.app import send_admin_abort
from tui.telemetry_feed import TelemetryFeed


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("curve") / "keys"
    assert main(["keys", str(path)]) == 0
    assert main(["keys", str(path), "--client", "intruder"]) == 0
    (path / CLIENTS / "intruder.key").unlink()  # a well-formed key pair the service never admits
    return path


@pytest.fixture(scope="module")
def service(model_path, keys):
    svc = ServiceProcess(model_path, "--curve-keys", str(keys), bind_host="0.0.0.0",
                         curve=curve_client(keys))
    yield svc
    assert svc.stop() == 0, svc.log_text()[-3000:]


def test_a_client_with_the_keys_generates_over_curve(service, keys):
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with Client(service.endpoint, curve=curve_client(keys)) as client:
        replies = list(client.generate("Say hi.", params=params))
    assert isinstance(replies[-1], Finished) and replies[-1].usage.completion_tokens == 8
    assert sum(len(m.token_ids) for m in replies if isinstance(m, Chunk)) == 8
    assert "CURVE on: admitting the client keys in" in service.log_text()
    assert main(["client", "--endpoint", service.endpoint, "--curve-keys", str(keys),
                 "--health"]) == 0


@pytest.mark.parametrize("who", ["plain", "intruder"])
def test_a_client_without_admitted_keys_gets_no_answer(service, keys, who):
    curve = None if who == "plain" else curve_client(keys, "intruder")
    with Client(service.endpoint, curve=curve, heartbeat_interval_s=0.2,
                service_timeout_s=1.0) as client:
        for _ in range(2):  # once refused, its socket has no connection to send on: no hang
            with pytest.raises(ServiceUnavailable):
                client.health(timeout_s=1.0)
            with pytest.raises(ServiceUnavailable):
                list(client.generate("Say hi."))
    refused = send_admin_abort(service.endpoint, "00/x", "token", curve, timeout_s=1.0)
    assert "no answer" in refused.text


def test_the_monitor_reads_telemetry_and_reaches_the_service_over_curve(service, keys):
    curve = curve_client(keys)
    # The service runs with no admin token: an answer at all shows the CURVE link works.
    answer = send_admin_abort(service.endpoint, "00/x", "token", curve)
    assert "[forbidden]" in answer.text
    feeds = {"curve": TelemetryFeed(f"tcp://127.0.0.1:{service.tport}", curve=curve),
             "plain": TelemetryFeed(f"tcp://127.0.0.1:{service.tport}")}
    threads = [threading.Thread(target=feed.run) for feed in feeds.values()]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while feeds["curve"].take() is None:
            assert time.monotonic() < deadline, "no telemetry over CURVE"
            time.sleep(0.05)
        time.sleep(1.0)  # four snapshots' time: none reaches the plain subscriber
        assert feeds["plain"].take() is None and feeds["plain"].status().frames == 0
    finally:
        for feed in feeds.values():
            feed.stop()
        for t in threads:
            t.join(timeout=5)
