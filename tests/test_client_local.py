"""The client library against a tiny fake service: a real ZMQ ROUTER on a random tcp port in a
thread, speaking the protocol by hand (plain msgpack maps, not our codec)."""

import asyncio
import threading
import time

import msgspec
import pytest
import zmq

from ipc.async_client import AsyncClient
from ipc.client import Client
from ipc.client_errors import RequestFailed, RequestTimeout, ServiceUnavailable
from ipc.client_messages import Chunk, Finished
from ipc.sampling import SamplingParams

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

STATS = {"type": "stats", "model": "fake", "device": "cpu", "worker_alive": True, "running": 0,
         "waiting": 0, "free_pages": 10, "total_pages": 10, "free_slots": 4, "total_slots": 4,
         "steps": 0, "output_tokens": 0}


class FakeService(threading.Thread):
    """Echo service: a Generate's reply is its prompt's words, one Chunk each, then Finished.

    It holds Generates until `batch` have arrived, then answers them interleaved (one word of
    each in turn, latest request first), so a client that routed by arrival order would mix
    them up. A prompt "error" gets an Error; `delay_s` delays every Generate's replies."""

    def __init__(self, batch: int = 1, delay_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.batch, self.delay_s = batch, delay_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.received: list[tuple[float, dict]] = []  # (time, message) of every frame
        self._pending: list[tuple[bytes, dict]] = []
        self._scheduled: list[tuple[float, bytes, dict]] = []
        self._stopping = threading.Event()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self._stopping.set()
        self.join(5)
        self.sock.close()
        self.ctx.term()

    def of_type(self, tag: str) -> list[dict]:
        return [m for _, m in list(self.received) if m.get("type") == tag]

    def run(self) -> None:
        while not self._stopping.is_set():
            if self.sock.poll(10):
                ident, frame = self.sock.recv_multipart()
                msg = unpack(frame)
                self.received.append((time.monotonic(), msg))
                self._handle(ident, msg)
            now = time.monotonic()
            due = [s for s in self._scheduled if s[0] <= now]
            self._scheduled = [s for s in self._scheduled if s[0] > now]
            for _, ident, reply in due:
                self.sock.send_multipart([ident, pack(reply)])

    def _handle(self, ident: bytes, msg: dict) -> None:
        tag = msg["type"]
        if tag == "health":
            self.sock.send_multipart([ident, pack(STATS)])
        elif tag == "ping":
            self.sock.send_multipart([ident, pack({"type": "pong"})])
        elif tag == "generate":
            self._pending.append((ident, msg))
            if len(self._pending) >= self.batch:
                self._answer(self._pending[::-1])
                self._pending = []

    def _answer(self, requests: list[tuple[bytes, dict]]) -> None:
        at = time.monotonic() + self.delay_s
        for _, m in requests:  # a chat request echoes its last message
            m["text"] = m.get("text") or m["messages"][-1]["content"]
        words = {m["id"]: m["text"].split() for _, m in requests}
        for ident, m in requests:
            if m["text"] == "error":
                self._scheduled.append((at, ident, {"type": "error", "id": m["id"],
                                                    "code": "prompt_too_long",
                                                    "message": "too long"}))
        requests = [(i, m) for i, m in requests if m["text"] != "error"]
        for k in range(max((len(w) for w in words.values()), default=0)):
            for ident, m in requests:
                if k < len(words[m["id"]]):
                    self._scheduled.append((at, ident, {
                        "type": "chunk", "id": m["id"], "token_ids": [k],
                        "text": (" " if k else "") + words[m["id"]][k]}))
        for ident, m in requests:
            usage = {"prompt_tokens": len(words[m["id"]]),
                     "completion_tokens": len(words[m["id"]])}
            self._scheduled.append((at, ident, {"type": "finished", "id": m["id"],
                                                "reason": "stop", "usage": usage}))


def free_endpoint() -> str:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(linger=0)
    return f"tcp://127.0.0.1:{port}"


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
        assert [m["id"] for m in service.of_type("abort")] == ["t1"]

    async def break_early(endpoint):
        async with AsyncClient(endpoint, timeout_s=5.0) as client:
            agen = client.generate("a b c d e f", request_id="t2")
            async for _ in agen:
                break
            await agen.aclose()
            await asyncio.sleep(0.1)

    with FakeService() as service:
        asyncio.run(break_early(service.endpoint))
        assert [m["id"] for m in service.of_type("abort")] == ["t2"]


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
        time.sleep(0.1)
        assert [m["id"] for m in service.of_type("abort")] == ["s1"]

    with Client(free_endpoint()) as client:
        with pytest.raises(ServiceUnavailable):
            client.health(timeout_s=0.2)


# ----- `fmserve client`: bad input is refused with a message, never a hang or a traceback ------

def test_client_command_with_no_service_says_so_instead_of_waiting_forever(capsys):
    from fmserve.cli import main

    endpoint = free_endpoint()
    rc: list[int] = []  # in a thread: a client that waits forever must fail the test, not hang it
    waiting = threading.Thread(target=lambda: rc.append(
        main(["client", "--endpoint", endpoint, "--prompt", "hello"])), daemon=True)
    waiting.start()
    waiting.join(30)  # the health check gives up after 5 s
    assert rc == [2], "fmserve client still waits for a service that is not there"
    err = capsys.readouterr().err
    assert err.startswith("fmserve: error: no answer from an fmserve service at " + endpoint)
    assert "Traceback" not in err
    with FakeService() as service:  # with a service there, the check passes unnoticed
        assert main(["client", "--endpoint", service.endpoint, "--prompt", "alpha beta",
                     "--raw"]) == 0
        assert capsys.readouterr().out == "alpha beta\n"


def test_client_command_refuses_bad_flags_and_bad_files(tmp_path, capsys):
    from fmserve.cli import main

    endpoint = free_endpoint()  # nothing listens: every case must fail before connecting
    bad_chat = tmp_path / "chat.jsonl"
    bad_chat.write_text('{"prompt": "fine"}\n{"messages": [{"role": "user"}]}\n')
    assert main(["client", "--endpoint", endpoint, "--file", str(bad_chat)]) == 2
    assert f"{bad_chat}:2: 'messages' must be a non-empty list" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    assert main(["client", "--endpoint", endpoint, "--file", str(latin1)]) == 2
    assert f"{latin1}: not UTF-8 text" in capsys.readouterr().err
    assert main(["client", "--endpoint", endpoint, "--file", str(tmp_path)]) == 2
    assert "Is a directory" in capsys.readouterr().err
    for flags, flag in ([["--concurrency", "0"], "--concurrency"],
                        [["--concurrency", "-3"], "--concurrency"],
                        [["--endpoint", "localhost:5557"], "--endpoint"]):
        with pytest.raises(SystemExit) as info:
            main(["client", "--file", str(bad_chat), *flags])
        assert info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
