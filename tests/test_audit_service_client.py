"""The reference client against a real service: requests the service cannot answer fail fast."""

from __future__ import annotations

import time

import pytest

from ipc.client import Client, RequestFailed
from ipc.client_messages import MAX_MESSAGE_BYTES
from ipc.sampling import SamplingParams
from tests.test_service import ServiceProcess


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
