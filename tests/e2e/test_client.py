"""The client library against a real service.

Liveness: a service that dies mid-stream: a request with no timeout_s
ends with ServiceUnavailable once the service has been silent for service_timeout_s, instead of
waiting forever; a long prefill, during which the service answers only Pings, is not taken for
a dead service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ipc.client import Client
from ipc.client_errors import ClientError, RequestFailed, ServiceUnavailable
from ipc.client_messages import MAX_MESSAGE_BYTES, Chunk, Finished
from ipc.sampling import SamplingParams
from tests.e2e import service_process
from tests.e2e.service_process import ROOT, ServiceProcess

SERVICE_TIMEOUT_S = 1.5


def test_a_killed_service_fails_the_stream_but_a_long_prefill_does_not(model_path):
    # The whole prompt is one worker step (max_tokens_per_step), which on a CPU takes seconds:
    # no Chunk for all that time, only Pongs from the service's event loop.
    svc = ServiceProcess(model_path, "--max-tokens-per-step", "4096")
    try:
        with Client(svc.endpoint, heartbeat_interval_s=0.2,
                    service_timeout_s=SERVICE_TIMEOUT_S) as client:
            done = client.complete("word " * 1000, params=SamplingParams(max_new_tokens=2))
            assert done.usage.prompt_tokens >= 1000 and done.finish_reason == "length"
            print(f"prefill of {done.usage.prompt_tokens} tokens: first token after "
                  f"{done.usage.ttft_ms / 1000:.1f} s (service_timeout_s {SERVICE_TIMEOUT_S})")

            ended: list[BaseException] = []
            killed: list[float] = []

            def stream() -> None:  # no timeout_s: only the liveness check can end it
                params = SamplingParams(temperature=0.0, max_new_tokens=3000, ignore_eos=True)
                chunks = 0
                try:
                    for msg in client.generate("Tell me a very long story.", params=params):
                        assert not isinstance(msg, Finished), "the stream ended before the kill"
                        chunks += isinstance(msg, Chunk)
                        if chunks == 3:
                            os.kill(svc.proc.pid, signal.SIGKILL)
                            killed.append(time.monotonic())
                except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                    ended.append(exc)
                ended.append(None)

            reader = threading.Thread(target=stream, daemon=True)
            reader.start()
            reader.join(timeout=120)  # a guard against hanging the suite, not a speed bound
            assert ended, "the stream still waits for a service that was killed"
            waited = time.monotonic() - killed[0]
    finally:
        svc.stop()
    assert isinstance(ended[0], ServiceUnavailable), ended
    assert svc.endpoint in str(ended[0]) and "has not answered" in str(ended[0])
    assert waited < 4 * SERVICE_TIMEOUT_S, f"the stream ended {waited:.1f} s after the kill"


def test_service_timeout_shorter_than_the_heartbeat_is_refused():
    with pytest.raises(ValueError, match="service_timeout_s = 1 must be longer than "
                                         "heartbeat_interval_s = 2"):
        Client("tcp://127.0.0.1:5557", service_timeout_s=1.0)


# ----- requests the service cannot answer fail fast -----
# The reference client against a real service: requests the service cannot answer fail fast.

@pytest.fixture(scope="module")
def service(model_path):
    svc = ServiceProcess(model_path)
    yield svc
    svc.stop()


def test_a_frame_far_over_the_limit_fails_instead_of_waiting_forever(service):
    # ZeroMQ drops the connection of a frame over 4x the service's limit without a word; the
    # client reconnected, its pings were answered, and the request waited forever.
    start = time.monotonic()
    with Client(service.endpoint) as client:
        with pytest.raises(RequestFailed) as failed:
            client.complete("x" * (5 * MAX_MESSAGE_BYTES), timeout_s=10.0,
                            params=SamplingParams(max_new_tokens=2))
        assert failed.value.code == "message_too_large"
        assert "max_message_bytes" in failed.value.message
        assert time.monotonic() - start < 5.0
        # the same client goes on serving
        assert client.complete("Hi", params=SamplingParams(max_new_tokens=2)).token_ids


def test_chat_goes_on_after_a_refused_message(service):
    # `fmserve client --chat`: one message the service refuses (too long for its context) ended
    # the whole conversation with an error; the next message was never sent.
    lines = "word " * 5000 + "\nSay hi.\n"
    proc = subprocess.run(
        [sys.executable, "-m", "fmserve.cli", "client", "--endpoint", service.endpoint, "--chat",
         "--max-new-tokens", "3", "--temperature", "0"],
        input=lines, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "prompt_too_long" in proc.stderr and "left out of the conversation" in proc.stderr
    replies = [line for line in proc.stdout.split("> ") if line.strip()]
    assert len(replies) == 1, proc.stdout  # the answer to "Say hi."


def test_a_late_abort_answer_does_not_fail_the_next_request_with_that_id(service):
    # An abort that comes too late (the request had finished) is answered with an
    # unknown_request error for that id. A request started right after with the same id (ids
    # need only be unique among those in flight) took that answer as its own and failed.
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    with Client(service.endpoint) as client:
        first = client.complete("Hi", params=params, request_id="again")
        client.abort("again")
        second = client.complete("Hi", params=params, request_id="again", timeout_s=10.0)
        assert second.token_ids == first.token_ids


# ----- a service restarted on the same endpoint -----
# A service killed and started again on the same endpoint while a client waits: the client's
# requests in flight were lost with the old service, and the client must say so, not wait.

def test_requests_in_flight_fail_when_the_service_restarts(model_path, monkeypatch):
    first = ServiceProcess(model_path)
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
        ports = iter([first.port, first.tport, first.http_port])
        monkeypatch.setattr(service_process, "free_port", lambda: next(ports))
        second = ServiceProcess(model_path)  # the same endpoint, a new service
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
