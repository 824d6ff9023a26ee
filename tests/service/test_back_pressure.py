"""Back-pressure: a client that never reads is cut off at service.max_queued_replies unread
replies (its request aborted), while another client's stream goes on unslowed."""

from __future__ import annotations

import threading
import time

import httpx2 as httpx
import zmq

from ipc.client import Client
from ipc.client_messages import Finished, Generate, Ping
from ipc.codec import encode
from ipc.sampling import SamplingParams
from tests.e2e.service_process import ServiceProcess, assert_idle


def cut_off_count(svc: ServiceProcess) -> float:
    for line in httpx.get(svc.http_url + "/metrics").text.splitlines():
        if line.startswith("fmserve:clients_cut_off_total "):
            return float(line.split()[1])
    raise AssertionError("no fmserve:clients_cut_off_total in /metrics")


def test_a_client_that_never_reads_is_cut_off_and_the_others_go_on(model_path):
    svc = ServiceProcess(model_path, "--set", "service.max_queued_replies=16")
    ctx = zmq.Context()
    try:
        other: list[object] = []

        def reader() -> None:  # a well-behaved client, streaming meanwhile
            with Client(svc.endpoint) as client:
                other.extend(client.generate("Tell me about rivers.", params=SamplingParams(
                    temperature=0.0, max_new_tokens=48, ignore_eos=True)))

        hog = ctx.socket(zmq.DEALER)
        hog.setsockopt(zmq.LINGER, 0)
        hog.setsockopt(zmq.RCVHWM, 1)
        hog.setsockopt(zmq.RCVBUF, 4096)  # the kernel holds little for it either
        hog.connect(svc.endpoint)
        hog.send(encode(Generate("long", text="Go on and on", params=SamplingParams(
            max_new_tokens=2000, ignore_eos=True))))
        t = threading.Thread(target=reader)
        t.start()
        ping = encode(Ping())
        deadline = time.monotonic() + 120
        while cut_off_count(svc) < 1:  # pings it never reads the pongs of
            assert time.monotonic() < deadline, "the client that never reads was not cut off"
            for _ in range(5000):
                hog.send(ping)
        t.join(timeout=120)
        assert isinstance(other[-1], Finished) and other[-1].reason == "length"
        assert sum(len(m.token_ids) for m in other[:-1]) == 48
        with Client(svc.endpoint) as client:
            assert_idle(client)  # the hog's 2000-token request was aborted with it
            assert client.health().running == 0
        hog.close()
    finally:
        ctx.term()
        assert svc.stop() == 0, svc.log_text()[-3000:]
    assert "cutting it off and aborting its 1 request(s)" in svc.log_text()
