"""A client that floods the service with pings or health requests must not stall everyone
else's generation: a real service, a real flooding socket, a real stream beside it."""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

from ipc.client import Client
from ipc.sampling import SamplingParams
from tests.test_service import ServiceProcess, assert_idle


def test_a_ping_and_health_flood_does_not_stall_generation(model_path):
    svc = ServiceProcess(model_path)
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(svc.endpoint)
        frames = [msgspec.msgpack.encode({"type": kind}) for kind in ("ping", "health")]
        try:
            while not stop.is_set():
                for i in range(200):
                    try:
                        sock.send(frames[i % 2], zmq.NOBLOCK)
                        sent[0] += 1
                    except zmq.Again:
                        pass
                while sock.poll(0):  # read the answers, or they pile up in the service
                    sock.recv()
        finally:
            sock.close()
            ctx.term()

    flooder = threading.Thread(target=flood)
    try:
        with Client(svc.endpoint) as client:
            flooder.start()
            time.sleep(0.5)
            # Alone this takes about a second. Before, the receive loop never yielded while
            # frames kept arriving (a ready zmq.asyncio recv completes without suspending), so
            # no step ran and not one token came while the flood lasted.
            c = client.complete("Tell me a story", timeout_s=10.0, params=SamplingParams(
                temperature=0.0, max_new_tokens=12, ignore_eos=True))
            assert len(c.token_ids) == 12 and c.finish_reason == "length"
            assert sent[0] > 1000, "the flood did not flood"
            stop.set()
            flooder.join(timeout=10)
            assert_idle(client)
    finally:
        stop.set()
        if flooder.is_alive():
            flooder.join(timeout=10)
        assert svc.stop() == 0, svc.log_text()[-3000:]
