"""The service end to end: a real `fmserve serve` process, its worker process, real sockets."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from ipc.client import Client
from ipc.client_errors import RequestFailed
from ipc.client_messages import Chunk, Error, Finished, Generate, Pong
from ipc.codec import decode_service_reply, encode
from ipc.sampling import SamplingParams
from service.tokenizer import TextTokenizer
from tests.e2e.service_process import (CLIENT_TIMEOUT_S, ServiceProcess, assert_idle,
                                       engine_greedy)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)
QUESTIONS = ["What is 2+2?", "Name a color.", "Write one word about the sea.",
             "Say hello in French."]


ADMIN_TOKEN = "test-admin-token-0123456789"


@pytest.fixture(scope="module")
def service(model_path):
    svc = ServiceProcess(model_path, "--set", f"service.admin_token={ADMIN_TOKEN}")
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy outputs of the offline engine: the independent side of the comparison."""
    return dict(zip(QUESTIONS, engine_greedy(model_path, QUESTIONS, GREEDY)))


def messages(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def assert_concurrent_streams_match(endpoint: str, reference) -> None:
    """Every question on its own connection at once: each stream equals the offline engine's."""
    results: dict[str, tuple[str, list[int], str]] = {}

    def run(q: str) -> None:
        with Client(endpoint) as client:
            text, ids, reason = "", [], None
            for msg in client.generate(messages=messages(q), params=GREEDY):
                if isinstance(msg, Chunk):
                    text += msg.text
                    ids += msg.token_ids
                elif isinstance(msg, Finished):
                    reason = msg.reason
            results[q] = (text, ids, reason)

    threads = [threading.Thread(target=run, args=(q,)) for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for q in QUESTIONS:
        text, ids, reason = results[q]
        assert ids == reference[q].token_ids
        assert text == reference[q].text
        assert reason == reference[q].finish_reason.value


def test_concurrent_clients_stream_the_offline_greedy_output(service, reference):
    assert_concurrent_streams_match(service.endpoint, reference)


def library_rss(pid: int, library: str) -> int:
    """Resident bytes of `library`'s mappings in process `pid`."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            inside = len(head) > 5 and head[5].endswith(library)
        elif inside and head[0] == "Rss:":
            total += int(head[1]) << 10
    return total


def test_the_worker_serves_with_torchs_start_up_code_released(service, reference):
    """`import torch` leaves ~60 MB of libtorch_cpu's code resident, run once by its op
    registrations; the worker drops it when loaded (ipc/process_heap.py). Serving brings back
    only what steps run, and streams the same tokens."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/<pid>/smaps to read")
    assert_concurrent_streams_match(service.endpoint, reference)
    pid = service.worker_pid()
    resident = library_rss(pid, "/libtorch_cpu.so")
    with Client(service.endpoint) as client:  # for the message: which decode step ran
        decode = client.health().decode_compile
    assert 0 < resident < 32 << 20, (f"libtorch_cpu.so: {resident >> 20} MB resident in worker "
                                     f"{pid} (decode step: {decode})")


def test_a_steps_replies_to_one_client_arrive_as_one_message_of_reply_frames(service,
                                                                             reference):
    """service/replies.py: the replies of one step to one client leave as one multipart
    message; each frame is one reply, so a client reading frame by frame sees every stream
    whole (the offline engine's tokens) and one terminal message per request."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 60_000)
    dealer.connect(service.endpoint)
    try:
        for i, q in enumerate(QUESTIONS):
            dealer.send(gen(id=f"q{i}", messages=messages(q), params=msgspec.to_builtins(GREEDY)))
        ids: dict[str, list[int]] = {f"q{i}": [] for i in range(len(QUESTIONS))}
        ends: dict[str, list[str]] = {rid: [] for rid in ids}
        widest = 0  # the most requests one message spoke for
        while sum(map(len, ends.values())) < len(QUESTIONS):
            # a sign of life, as a client's heartbeat: this service drops clients silent for
            # CLIENT_TIMEOUT_S, and four streams of 20 tokens can take longer on a busy machine
            dealer.send(msgspec.msgpack.encode({"type": "ping"}))
            replies = [decode_service_reply(frame) for frame in dealer.recv_multipart()]
            replies = [r for r in replies if not isinstance(r, Pong)]
            widest = max(widest, len({r.id for r in replies}))
            for reply in replies:
                if isinstance(reply, Chunk):
                    ids[reply.id] += reply.token_ids
                else:
                    assert isinstance(reply, Finished), reply
                    ends[reply.id].append(reply.reason)
    finally:
        dealer.close()
        ctx.term()
    assert widest > 1  # the streams of one step shared a message
    for i, q in enumerate(QUESTIONS):
        assert ids[f"q{i}"] == reference[q].token_ids
        assert ends[f"q{i}"] == [reference[q].finish_reason.value]


def test_many_requests_on_one_connection_and_non_streaming(service, reference):
    import asyncio

    from ipc.async_client import AsyncClient

    async def main():
        async with AsyncClient(service.endpoint) as client:
            return await asyncio.gather(*(client.complete(messages=messages(q), params=GREEDY)
                                          for q in QUESTIONS))
    for q, c in zip(QUESTIONS, asyncio.run(main())):
        assert c.token_ids == reference[q].token_ids
    with Client(service.endpoint) as client:
        chunks = list(client.generate(messages=messages(QUESTIONS[0]), params=GREEDY, stream=False))
        assert [type(m) for m in chunks] == [Chunk, Finished]
        assert chunks[0].token_ids == reference[QUESTIONS[0]].token_ids


def test_stop_string_cuts_exactly(service, reference):
    full = reference[QUESTIONS[2]].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"pick a better stop from {full!r}"
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop=[stop])
    with Client(service.endpoint) as client:
        c = client.complete(messages=messages(QUESTIONS[2]), params=params)
    assert c.text == full[: full.index(stop)]
    assert c.finish_reason == "stop"


def assert_abort_mid_stream_ends_once(endpoint: str, request_id: str) -> None:
    """Abort a long request after three chunks: exactly one terminal message (the abort), and
    its pages and slot come back."""
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    with Client(endpoint) as client:
        got = []
        for msg in client.generate(messages=messages("Count to one thousand."), params=params,
                                   request_id=request_id):
            got.append(msg)
            if sum(isinstance(m, Chunk) for m in got) == 3:
                client.abort(request_id)
        assert isinstance(got[-1], Finished) and got[-1].reason == "abort"
        assert sum(isinstance(m, (Finished, Error)) for m in got) == 1
        assert_idle(client)


def test_abort_mid_stream_frees_pages_and_slot(service):
    assert_abort_mid_stream_ends_once(service.endpoint, "long-1")


def test_worker_preparing_ahead_streams_the_same_and_aborts_cleanly(model_path, reference):
    # launch_ahead "prepare" (meant for GPUs, forced here): with overlap the worker applies
    # plan k+1 before it sends result k. Same streams, an abort mid-stream ends with exactly one
    # terminal message, and the accounting returns to idle.
    svc = ServiceProcess(model_path, "--overlap", "--set", "scheduling.launch_ahead=prepare")
    try:
        assert_concurrent_streams_match(svc.endpoint, reference)
        assert_abort_mid_stream_ends_once(svc.endpoint, "long-2")
    finally:
        assert svc.stop() == 0, svc.log_text()


def test_vanished_client_is_detected_and_its_requests_aborted(service):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    sock.send(encode(Generate(id="ghost", messages=None, text="Tell me a long story.",
                              params=SamplingParams(max_new_tokens=2000, ignore_eos=True))))
    assert sock.poll(30000), "no reply to the ghost request"
    sock.close()  # no heartbeats from now on
    ctx.term()
    with Client(service.endpoint) as client:  # idle once the ghost's request is aborted
        assert_idle(client, timeout_s=CLIENT_TIMEOUT_S + 10)
    assert "silent" in service.log_text()


def gen(**fields) -> bytes:
    return msgspec.msgpack.encode({"type": "generate", "id": "x", **fields})


@pytest.mark.parametrize("frame, code, rid", [
    (b"\xc1\xff not msgpack", "invalid_message", None),
    (msgspec.msgpack.encode({"type": "teleport", "id": "x"}), "unknown_message_type", None),
    (gen(text=5), "invalid_message", "x"),
    (gen(text="hi", colour=1), "invalid_message", "x"),
    (gen(text="hi", params={"temperature": -1.0}), "invalid_params", "x"),
    (gen(text="hi", params={"top_p": 0.0}), "invalid_params", "x"),
    # refused at admission, against the vocabulary: its message used to show the internal key
    pytest.param(gen(text="hi", params={"top_k": 10**6}), "invalid_params", "x",
                 id="top-k-over-vocab"),
    (gen(text="word " * 9000), "prompt_too_long", "x"),
    (gen(text="x" * (9 << 20)), "message_too_large", "x"),
    (msgspec.msgpack.encode({"type": "abort", "id": "never-sent"}), "unknown_request",
     "never-sent"),
    # a str that is not UTF-8 (a lone surrogate), and nesting too deep: these ended the service,
    # then were answered with id None although the id was readable
    pytest.param(b"\x83\xa4type\xa8generate\xa2id\xa1x\xa4text\xa3\xed\xa0\x80",
                 "invalid_message", "x", id="text-not-utf8"),
    pytest.param(b"\x83\xa4type\xa8generate\xa2id\xa1x\xa4text" + b"\x91" * 100_000 + b"\xc0",
                 "invalid_message", "x", id="deep-text"),
    pytest.param(b"\x91" * 100_000 + b"\xc0", "invalid_message", None, id="deep-nesting"),
    # min_new_tokens lives in an int64 in the worker: this one used to kill it (worker_died)
    pytest.param(gen(text="hi", params={"max_new_tokens": 2**64 - 1, "min_new_tokens": 2**63}),
                 "invalid_params", "x", id="min-new-tokens-over-int64"),
])
def test_bad_input_gets_a_clear_error(service, frame, code, rid):
    """Each gets an Error with its code and the request's id when the frame shows one; no
    message quotes the service's internal key (the connection's identity)."""
    identity = b"client-\xc0\xff\xee"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(service.endpoint)
    try:
        sock.send(frame)
        assert sock.poll(30000), f"no reply for {code}"
        reply = decode_service_reply(sock.recv())
        assert isinstance(reply, Error), reply
        assert (reply.code, reply.id) == (code, rid), reply
        assert len(reply.message) > 15
        assert identity.hex() not in reply.message, reply
    finally:
        sock.close()
        ctx.term()
    with Client(service.endpoint) as client:  # and the service still serves everyone
        assert client.complete("Hi", params=SamplingParams(max_new_tokens=2)).token_ids


def test_multipart_message_gets_an_error_not_silence(service):
    """A REQ socket (empty delimiter + payload) or a DEALER sending several frames used to be
    dropped without a word, leaving the client waiting forever."""
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    dealer = ctx.socket(zmq.DEALER)
    try:
        for sock in (req, dealer):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(service.endpoint)
        req.send(encode(Generate(id="r", text="hi")))
        dealer.send_multipart([encode(Generate(id="d", text="hi")), b"extra"])
        for sock in (req, dealer):
            assert sock.poll(10000), "no reply to a multipart message"
            reply = decode_service_reply(sock.recv())
            assert isinstance(reply, Error) and reply.code == "invalid_message", reply
            assert "frames" in reply.message and "DEALER" in reply.message
    finally:
        req.close()
        dealer.close()
        ctx.term()


def test_registry_forgets_quiet_clients_with_nothing_in_flight():
    from service.client_registry import ClientRegistry

    reg = ClientRegistry()
    for identity in (b"gone", b"busy"):
        reg.touch(identity)
    reg.add(b"busy", "1", stream=True)
    time.sleep(0.01)
    assert reg.silent_clients(timeout_s=0.001) == [b"busy"]
    assert list(reg._last_seen) == [b"busy"]  # one entry per connection ever seen would leak


def test_worker_killed_mid_batch_errors_in_flight_then_recovers(model_path):
    svc = ServiceProcess(model_path)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=500, ignore_eos=True)
        outcomes: list[object] = []

        def run(i: int) -> None:
            with Client(svc.endpoint) as client:
                try:
                    outcomes.append(client.complete(f"Story {i}:", params=params))
                except RequestFailed as exc:
                    outcomes.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        with Client(svc.endpoint) as client:
            deadline = time.monotonic() + 60
            while client.health().running < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(svc.worker_pid(), signal.SIGKILL)
            for t in threads:
                t.join(timeout=60)
            assert len(outcomes) == 3
            assert all(isinstance(o, RequestFailed) and o.code == "worker_died" for o in outcomes)
            c = client.complete("Hello", params=SamplingParams(max_new_tokens=3),
                                timeout_s=180)
            assert len(c.token_ids) == 3
            assert_idle(client)
    finally:
        svc.stop()


def test_sigterm_drains_then_shuts_down_cleanly(model_path):
    """SIGTERM: new requests are refused at once, a request that can finish within
    service.drain_timeout_s does, one that cannot ends with service_shutdown at the timeout."""
    # "short" (8 tokens, decoding when the signal comes) must end within the drain on a loaded
    # 2-core CPU; "long" (6000) must not: an H200 served it whole within a 10 s drain (~600
    # tok/s), so a GPU drains for 2 s
    drain_s = 2 if torch.cuda.is_available() else 5
    svc = ServiceProcess(model_path, "--set", f"service.drain_timeout_s={drain_s}")
    worker = svc.worker_pid()
    replies: dict[str, object] = {}

    def run(name: str, tokens: int) -> None:
        with Client(svc.endpoint) as client:
            try:
                replies[name] = client.complete(
                    "Go on and on", params=SamplingParams(max_new_tokens=tokens,
                                                          ignore_eos=True), timeout_s=60)
            except RequestFailed as exc:
                replies[name] = exc

    threads = [threading.Thread(target=run, args=a) for a in (("short", 8), ("long", 6000))]
    for t in threads:
        t.start()
    with Client(svc.endpoint) as client:
        deadline = time.monotonic() + 60
        while client.health().running < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not client.health().draining:
            assert time.monotonic() < deadline, "Stats never said draining"
            time.sleep(0.05)
        with pytest.raises(RequestFailed) as refused:
            client.complete("Hello", params=GREEDY)
        assert refused.value.code == "shutting_down"
        import httpx2
        health = httpx2.get(svc.http_url + "/health")  # a load balancer stops routing here
        assert (health.status_code, health.json()["status"]) == (503, "draining")
    started = time.monotonic()
    assert svc.proc.wait(timeout=30) == 0  # no second signal: that one stops at once
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - started < 25
    assert not isinstance(replies["short"], RequestFailed), replies["short"]
    assert replies["short"].finish_reason == "length"
    assert len(replies["short"].token_ids) == 8
    assert isinstance(replies["long"], RequestFailed)
    assert replies["long"].code == "service_shutdown"
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(worker, 0)
            time.sleep(0.1)
    for port in (svc.port, svc.tport):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if the service still holds it


def test_another_client_aborts_a_request_only_with_the_admin_token(service):
    """The attack: a second connection ends the owner's request by the key telemetry shows.
    Without the admin token (none, or a wrong one) it is refused and the request runs on to
    its end; a plain abort reaches only the sender's own requests; with the token it works.
    Telemetry carries no output text by default."""
    from ipc.client_messages import Abort, AdminAbort, Aborted
    from ipc.telemetry import TelemetrySnapshot

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{service.tport}")
    other = ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    other.connect(service.endpoint)
    decoder = msgspec.msgpack.Decoder(TelemetrySnapshot)
    got: dict[str, list] = {}

    def owner(rid: str, max_new_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
        with Client(service.endpoint) as client:
            got[rid] = list(client.generate("Tell me everything.", params=params,
                                            request_id=rid))

    def running_key(rid: str) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sub.poll(1000):
                snap = decoder.decode(sub.recv())
                for r in snap.running:
                    assert r.text_tail is None  # service.telemetry_include_text is off
                    if r.id == rid and r.generated > 0:
                        return r.key
        raise AssertionError(f"{rid} never showed up running in telemetry")

    def answer(msg) -> object:
        other.send(encode(msg))
        assert other.poll(10000), f"no answer to {msg}"
        return decode_service_reply(other.recv())

    victim = threading.Thread(target=owner, args=("victim", 160))
    victim.start()
    try:
        key = running_key("victim")
        for token in ("", "wrong-token", ADMIN_TOKEN[:-1]):
            refusal = answer(AdminAbort(key, token))
            assert isinstance(refusal, Error) and refusal.code == "forbidden", refusal
            assert "admin token is missing or wrong" in refusal.message
        for rid in (key, "victim"):  # Abort is scoped to the sender's own connection
            assert answer(Abort(rid)).code == "unknown_request"
        victim.join(timeout=120)
        assert isinstance(got["victim"][-1], Finished) and got["victim"][-1].reason == "length"
        assert got["victim"][-1].usage.completion_tokens == 160

        owned = threading.Thread(target=owner, args=("owned", 2000))
        owned.start()
        key = running_key("owned")
        assert isinstance(answer(AdminAbort(key, ADMIN_TOKEN)), Aborted)
        owned.join(timeout=30)
        assert isinstance(got["owned"][-1], Finished) and got["owned"][-1].reason == "abort"
    finally:
        victim.join(timeout=120)
        sub.close()
        other.close()
        ctx.term()


def test_admin_operations_without_a_configured_token_say_how_to_enable_them(model_path):
    from ipc.client_messages import AdminAbort

    replies: list = []

    def client(ctx, endpoint) -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(endpoint)
        try:
            for token in ("", "anything"):
                dealer.send(encode(AdminAbort("00/x", token)))
                replies.append(decode_service_reply(dealer.recv()))
        finally:
            dealer.close()

    in_process_receive_loop(model_path, client)  # the default config: no admin token
    for reply in replies:
        assert isinstance(reply, Error) and reply.code == "forbidden", reply
        assert "admin_abort is disabled: this service has no admin token" in reply.message
        assert "service.admin_token" in reply.message and "FMSERVE_ADMIN_TOKEN" in reply.message


def test_speculative_service_streams_the_greedy_output(model_path, reference):
    """EAGLE-3 tree speculation under overlap behind real sockets: concurrent streams equal the
    plain offline engine, usage reports acceptance, telemetry carries it, accounting empties."""
    svc = ServiceProcess(model_path, "--overlap", "--spec-algorithm", "eagle3",
                         "--spec-num-steps", "3", "--spec-topk", "2",
                         "--spec-num-draft-tokens", "6")
    try:
        results: dict[str, tuple[list[int], Finished | None]] = {}

        def run(q: str) -> None:
            ids, fin = [], None
            with Client(svc.endpoint) as client:
                for msg in client.generate(messages=messages(q), params=GREEDY):
                    if isinstance(msg, Chunk):
                        ids += msg.token_ids
                    elif isinstance(msg, (Finished, Error)):
                        fin = msg
            results[q] = (ids, fin)

        threads = [threading.Thread(target=run, args=(q,)) for q in QUESTIONS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        verify_steps = accepted = 0
        for q in QUESTIONS:
            ids, fin = results[q]
            assert isinstance(fin, Finished), fin
            assert ids == reference[q].token_ids
            assert fin.usage.completion_tokens == len(ids)
            verify_steps += fin.usage.spec_verify_steps
            accepted += fin.usage.spec_accepted_drafts
            if fin.usage.spec_verify_steps:
                assert fin.usage.spec_accept_length >= 1.0
        assert verify_steps > 0
        # Prometheus says what the requests' usage says (6 tokens verified: 5 drafts a step).
        from prometheus_client.parser import text_string_to_metric_families
        import httpx2
        samples = {s.name: s.value for fam in text_string_to_metric_families(
            httpx2.get(svc.http_url + "/metrics").text) for s in fam.samples}
        assert samples["fmserve:spec_decode_num_drafts_total"] == verify_steps
        assert samples["fmserve:spec_decode_num_accepted_tokens_total"] == accepted
        assert samples["fmserve:spec_decode_num_draft_tokens_total"] == 5 * verify_steps
        assert samples["fmserve:spec_decode_mean_accept_length"] == pytest.approx(
            (verify_steps + accepted) / verify_steps)
        with Client(svc.endpoint) as client:
            assert_idle(client)
    finally:
        assert svc.stop() == 0, svc.log_text()[-3000:]


def in_process_receive_loop(model_path, client_fn, endpoint: str = "tcp://127.0.0.1:0",
                            patch=None) -> None:
    """The service's receive loop in this process on a real ROUTER socket (no worker):
    client_fn(ctx, endpoint) runs in a thread against it. patch(svc) may inject a fault."""
    import anyio

    from service.config import load_config
    from service.server import Service

    svc = Service(load_config(), str(model_path))
    if patch is not None:
        patch(svc)
    svc.router.bind(endpoint)
    bound = svc.router.getsockopt(zmq.LAST_ENDPOINT).decode()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(svc._receive_loop)
            # The same context: inproc endpoints are per context.
            await anyio.to_thread.run_sync(client_fn, zmq.Context.shadow(svc._ctx), bound)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main, backend="asyncio")
    finally:
        svc.router.close(linger=0)
        svc.telemetry.close()
        svc._ctx.term()


def test_a_failure_handling_one_message_answers_internal_error_and_serves_on(model_path,
                                                                           monkeypatch):
    """A fault injected into what one message calls (health's stats): that client gets
    `internal_error`, the loop lives on and answers the next message. Before, any such
    exception ended the service."""
    def broken_stats(*args, **kwargs):
        raise RuntimeError("injected fault")

    replies: list = []

    def client(ctx, endpoint) -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(endpoint)
        try:
            for kind in ("health", "ping"):
                dealer.send(msgspec.msgpack.encode({"type": kind}))
                replies.append(decode_service_reply(dealer.recv()))
        finally:
            dealer.close()

    in_process_receive_loop(model_path, client,
                            patch=lambda svc: monkeypatch.setattr(svc.counters, "stats",
                                                                  broken_stats))
    assert len(replies) == 2
    assert isinstance(replies[0], Error) and replies[0].code == "internal_error", replies[0]
    assert "Health" in replies[0].message
    assert type(replies[1]).__name__ == "Pong"


def test_a_client_that_reads_late_loses_no_reply(model_path):
    """3,000 pings sent before reading one reply, over inproc (no kernel buffers: only the two
    sockets' queues hold what is unread): every pong arrives. At ZeroMQ's default send limit
    (1,000 per client) the rest were dropped without a word, terminal messages included."""
    n = 3000
    got: list[int] = []

    def client(ctx, endpoint) -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 10)
        dealer.setsockopt(zmq.RCVTIMEO, 2_000)
        dealer.connect(endpoint)
        try:
            ping = msgspec.msgpack.encode({"type": "ping"})
            for _ in range(n):
                dealer.send(ping)
            time.sleep(1.0)  # let the service answer them all before anything is read
            try:
                while True:
                    dealer.recv()
                    got.append(1)
            except zmq.Again:
                pass
        finally:
            dealer.close()

    in_process_receive_loop(model_path, client, endpoint="inproc://late-reader")
    assert len(got) == n


# ----- a flood of pings and health requests -----
# A client that floods the service with pings or health requests must not stall everyone
# else's generation: a real service, a real flooding socket, a real stream beside it.

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


# ----- streamed text that splits UTF-8 characters -----
# Streamed text of a real service when tokens split UTF-8 characters: nothing lost at the end.

EMOJI_CHAT = [{"role": "user", "content": "Write three emoji in a row."}]


def stream(endpoint: str, max_new_tokens: int) -> tuple[list[Chunk], Finished]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    with Client(endpoint) as client:
        replies = list(client.generate(messages=EMOJI_CHAT, params=params, timeout_s=30.0))
    return replies[:-1], replies[-1]


def test_a_request_cut_mid_character_keeps_its_last_bytes(service, model_path):
    tokenizer = TextTokenizer.from_model_path(model_path)
    chunks, _ = stream(service.endpoint, 40)
    ids = [t for c in chunks for t in c.token_ids]
    # Mid-stream no chunk holds part of a character (the last may: it may end inside one).
    assert not any("\ufffd" in c.text for c in chunks[:-1]), "a partial character was streamed"
    # The first length at which the output ends inside a multi-byte character (an emoji is
    # three tokens of this model).
    cut = next((n for n in range(1, len(ids) + 1)
                if tokenizer.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd")), None)
    assert cut is not None, f"the model wrote no multi-token character: {ids}"
    chunks, fin = stream(service.endpoint, cut)
    assert fin.reason == "length"
    assert [t for c in chunks for t in c.token_ids] == ids[:cut]
    # The concatenated text is the text of the tokens: the held-back bytes of the unfinished
    # character come with the last chunk (as U+FFFD) rather than vanishing. Before, the text
    # simply stopped short of them.
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids[:cut], skip_special_tokens=True)
