"""The client library against a real service that dies mid-stream: a request with no timeout_s
ends with ServiceUnavailable once the service has been silent for service_timeout_s, instead of
waiting forever; a long prefill, during which the service answers only Pings, is not taken for
a dead service."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ipc.client import Client
from ipc.client_errors import ServiceUnavailable
from ipc.client_messages import Chunk, Finished
from ipc.sampling import SamplingParams
from tests.test_service import ServiceProcess

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
