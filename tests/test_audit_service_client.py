"""The reference client against a real service: requests the service cannot answer fail fast."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ipc.client import Client
from ipc.client_errors import RequestFailed
from ipc.client_messages import MAX_MESSAGE_BYTES
from ipc.sampling import SamplingParams
from tests.test_service import ROOT, ServiceProcess


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
