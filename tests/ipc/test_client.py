"""The client library against a tiny fake service (tests/ipc/fake_service.py): a real ZMQ ROUTER
on a random tcp port in a thread, speaking the protocol by hand (plain msgpack maps, not our
codec)."""

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from ipc.async_client import AsyncClient
from ipc.client import Client
from ipc.client_errors import RequestFailed, RequestTimeout, ServiceUnavailable
from ipc.client_messages import Chunk, Finished
from ipc.sampling import SamplingParams
from tests.ipc.fake_service import FakeService, free_endpoint

PROMPTS = ["alpha beta gamma delta", "one two three", "red green blue yellow purple"]


def test_concurrent_requests_are_routed_by_id():
    async def main(endpoint):
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            return await asyncio.gather(*(client.complete(p) for p in PROMPTS))

    with FakeService(batch=len(PROMPTS)) as service:
        results = asyncio.run(main(service.endpoint))
        assert [r.text for r in results] == PROMPTS
        assert [r.token_ids for r in results] == [list(range(len(p.split()))) for p in PROMPTS]
        assert all(r.finish_reason == "stop" for r in results)
        assert [r.usage.completion_tokens for r in results] == [len(p.split()) for p in PROMPTS]
        sent = service.of_type("generate")
        assert sorted(m["text"] for m in sent) == sorted(PROMPTS)
        assert len({m["id"] for m in sent}) == len(PROMPTS)


def test_stream_yields_chunks_then_finished():
    async def main(endpoint):
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            return [m async for m in client.generate(
                "a b c", params=SamplingParams(temperature=0), request_id="mine")]

    with FakeService() as service:
        replies = asyncio.run(main(service.endpoint))
        assert [type(r) for r in replies] == [Chunk, Chunk, Chunk, Finished]
        assert all(r.id == "mine" for r in replies)
        assert service.of_type("generate")[0]["params"]["temperature"] == 0


def test_heartbeat_while_in_flight_only():
    async def main(endpoint):
        async with AsyncClient(endpoint, heartbeat_interval_s=0.05, timeout_s=5.0) as client:
            await client.complete("x y")  # the service holds it for 0.5 s
            pings_done = len(service.of_type("ping"))
            await asyncio.sleep(0.3)  # idle: no pings
            return pings_done

    with FakeService(delay_s=0.5) as service:
        pings_done = asyncio.run(main(service.endpoint))
        assert 3 <= pings_done <= 12  # about 0.5 s / 0.05 s; slack for a busy machine
        time.sleep(0.05)
        assert len(service.of_type("ping")) <= pings_done + 1
        times = [t for t, m in service.received if m["type"] == "ping"]
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) < 0.4


def test_error_reply_raises_request_failed():
    async def main(endpoint):
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            with pytest.raises(RequestFailed) as info:
                await client.complete("error", request_id="bad-one")
            assert info.value.code == "prompt_too_long" and info.value.request_id == "bad-one"
            # the client stays usable
            assert (await client.complete("still fine")).text == "still fine"

    with FakeService() as service:
        asyncio.run(main(service.endpoint))


def test_invalid_request_is_refused_before_sending():
    async def main(endpoint):
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            with pytest.raises(RequestFailed) as info:
                await client.complete("x", params=SamplingParams(temperature=-1))
            assert info.value.code == "invalid_params"
            with pytest.raises(RequestFailed) as info:
                await client.complete("x", token_ids=[1])
            assert info.value.code == "invalid_message"

    with FakeService() as service:
        asyncio.run(main(service.endpoint))
        assert service.of_type("generate") == []


def test_timeout_and_early_exit_abort_the_request():
    async def main(endpoint):
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            with pytest.raises(RequestTimeout):
                await client.complete("slow request", request_id="t1", timeout_s=0.2)
            await asyncio.sleep(0.1)
            assert client.requests_in_flight == 0

    with FakeService(delay_s=5.0) as service:
        asyncio.run(main(service.endpoint))
        assert service.ids_of("abort") == ["t1"]

    async def break_early(endpoint):
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            agen = client.generate("a b c d e f", request_id="t2")
            async for _ in agen:
                break
            await agen.aclose()
            await asyncio.sleep(0.1)

    with FakeService() as service:
        asyncio.run(break_early(service.endpoint))
        assert service.ids_of("abort") == ["t2"]


def test_health_and_service_unavailable():
    async def main(endpoint):
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            return await client.health(timeout_s=2.0)

    with FakeService() as service:
        stats = asyncio.run(main(service.endpoint))
        assert stats.model == "fake" and stats.total_slots == 4

    endpoint = free_endpoint()

    async def nobody_home():
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            with pytest.raises(ServiceUnavailable) as info:
                await client.health(timeout_s=0.3)
            return str(info.value)

    message = asyncio.run(nobody_home())
    assert endpoint in message and "fmserve serve" in message


def test_sync_client():
    with FakeService(batch=1) as service, Client(service.endpoint, timeout_s=5.0) as client:
        assert client.health(timeout_s=2.0).model == "fake"
        texts = [m.text for m in client.generate("hello there world") if isinstance(m, Chunk)]
        assert "".join(texts) == "hello there world"
        done = client.complete(messages=[{"role": "user", "content": "a b"}])
        assert done.text == "a b" and done.finish_reason == "stop"
        with pytest.raises(RequestFailed):
            client.complete("error")
        stream = client.generate("p q r s", request_id="s1")
        next(stream)
        stream.close()  # leaving early aborts
        assert service.ids_of("abort") == ["s1"]

    with Client(free_endpoint()) as client:
        with pytest.raises(ServiceUnavailable):
            client.health(timeout_s=0.2)


def test_a_service_gone_after_taking_the_request_fails_it_even_when_pings_cannot_be_sent():
    # IMMEDIATE: once the service's socket closes the client keeps no pipe to queue on, so its
    # pings wait to send (as under a CURVE refusal); the silence must still fail the request.
    ctx = zmq.asyncio.Context()
    ctx.setsockopt(zmq.IMMEDIATE, 1)
    server = zmq.Context.instance().socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")

    async def main():
        async with AsyncClient(f"tcp://127.0.0.1:{port}", heartbeat_interval_s=0.1,
                               service_timeout_s=0.8, context=ctx) as client:
            async def request():
                async for _ in client.generate("held forever"):
                    pass

            task = asyncio.create_task(request())
            while not server.poll(0):
                await asyncio.sleep(0.01)
            server.close(linger=0)  # took the request, then went away
            started = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="has not answered"):
                await asyncio.wait_for(task, timeout=10)
            return time.monotonic() - started

    try:
        assert asyncio.run(main()) < 5
    finally:
        server.close(linger=0)
        ctx.term()
