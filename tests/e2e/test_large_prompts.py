"""Large text prompts against a real `fmserve serve`: a text that cannot fit is refused without
being tokenized, a large one is tokenized off the event loop (other clients and Pings are
answered meanwhile), and a request still being tokenized follows the protocol: an abort ends it
with exactly one terminal message, and one that fits runs like any other.

Tokenizing an 8 MB text held the service's event loop (and the GIL) for about 6 s: no reply to
anyone, not even a Pong."""

from __future__ import annotations

import time

import pytest
import zmq

from ipc.client import Client
from ipc.client_errors import RequestFailed
from ipc.client_messages import Abort, Chunk, Error, Finished, Generate, Ping, Pong
from ipc.codec import decode_service_reply, encode
from ipc.sampling import SamplingParams
from service.tokenizer import TextTokenizer
from tests.e2e.service_process import ServiceProcess, assert_idle

# The service below holds 4096 KV tokens: prompts must be shorter than 4080 tokens.
LIMIT = 4080
# Not provably too long from its bytes (< LIMIT tokens by the bound), but 133k tokens: it is
# tokenized (~0.3 s on a thread) and then refused.
LARGE = ("The quick brown fox jumps over the lazy dog. " * 20000)[:600_000]
# 81 KB that fits: 1,000 tokens of a newline and 80 spaces each.
LARGE_FITTING = ("\n" + " " * 80) * 1000


@pytest.fixture(scope="module")
def service(model_path):
    svc = ServiceProcess(model_path)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return TextTokenizer.from_model_path(model_path)


@pytest.fixture
def dealer(service):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.endpoint)
    yield sock
    sock.close()
    ctx.term()


def recv(sock: zmq.Socket):
    assert sock.poll(60_000), "no reply within 60 s"
    return decode_service_reply(sock.recv())


def test_the_texts_are_what_the_tests_need(tokenizer):
    assert tokenizer.min_tokens(LARGE) < LIMIT < len(tokenizer.encode(LARGE))
    assert len(LARGE_FITTING.encode()) > 64 << 10 and len(tokenizer.encode(LARGE_FITTING)) < LIMIT


def test_an_8mb_prompt_is_refused_at_once_without_tokenizing(service, tokenizer):
    text = "The quick brown fox jumps over the lazy dog. " * 180_000  # 8.1 MB, under the frame limit
    with Client(service.endpoint) as client:
        with pytest.raises(RequestFailed) as info:
            client.complete(text, params=SamplingParams(max_new_tokens=2))
        assert info.value.code == "prompt_too_long"
        assert f"{len(text.encode()):,} bytes" in info.value.message
        assert "refused without tokenizing" in info.value.message and "shorten it" in info.value.message
        with pytest.raises(RequestFailed, match="without tokenizing"):  # a chat too
            client.complete(messages=[{"role": "user", "content": text}])
        assert client.complete("Hi", params=SamplingParams(max_new_tokens=2)).token_ids


def test_a_large_prompt_is_tokenized_while_other_clients_are_answered(service, dealer):
    with Client(service.endpoint) as other:
        other.health()  # connected before the large prompt goes out
        dealer.send(encode(Generate(id="big", text=LARGE)))
        dealer.send(encode(Ping()))  # read by the service after the prompt, on one connection
        # The Ping is answered before the prompt's refusal: the loop was free meanwhile.
        first = recv(dealer)
        assert isinstance(first, Pong), first
        stats = other.health()  # another client, answered meanwhile too
        assert stats.waiting == 1  # the prompt being tokenized counts as waiting
        assert not dealer.poll(0), "the large prompt was refused before the other client's answer"
        last = recv(dealer)
    assert isinstance(last, Error) and last.id == "big" and last.code == "prompt_too_long", last
    assert "133,333 tokens" in last.message or "133333 tokens" in last.message


def test_an_abort_while_tokenizing_ends_the_request_once(service, dealer):
    dealer.send(encode(Generate(id="x", text=LARGE)))
    dealer.send(encode(Abort(id="x")))
    dealer.send(encode(Ping()))
    replies = [recv(dealer), recv(dealer)]
    assert isinstance(replies[0], Finished) and replies[0].id == "x", replies
    assert replies[0].reason == "abort" and isinstance(replies[1], Pong), replies
    # The id is free again at once, while the thread of the aborted prompt may still run; a
    # second large prompt queues behind that thread, so once it is answered the aborted one
    # has surely finished tokenizing, and it must not have been admitted or answered again.
    dealer.send(encode(Generate(id="x", text="Hi", params=SamplingParams(max_new_tokens=3))))
    dealer.send(encode(Generate(id="y", text=LARGE)))
    terminal: dict[str, list] = {"x": [], "y": []}
    while not (terminal["x"] and terminal["y"]):
        msg = recv(dealer)
        if not isinstance(msg, Chunk):
            terminal[msg.id].append(msg)
    dealer.send(encode(Ping()))
    while not isinstance(msg := recv(dealer), Pong):
        if not isinstance(msg, Chunk):
            terminal[msg.id].append(msg)
    assert [type(m) for m in terminal["x"]] == [Finished], terminal
    assert terminal["x"][0].usage.completion_tokens == 3
    assert [(type(m), m.code) for m in terminal["y"]] == [(Error, "prompt_too_long")]
    with Client(service.endpoint) as client:
        assert_idle(client)


def test_a_large_prompt_that_fits_runs_like_any_other(service, tokenizer):
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    chat = [{"role": "user", "content": LARGE_FITTING}]
    with Client(service.endpoint) as client:
        done = client.complete(LARGE_FITTING, params=params)
        assert done.usage.prompt_tokens == len(tokenizer.encode(LARGE_FITTING))
        assert len(done.token_ids) == 4 and done.finish_reason == "length"
        done = client.complete(messages=chat, params=params)
        assert done.usage.prompt_tokens == len(tokenizer.encode_chat(chat))
        assert_idle(client)


def test_a_client_gone_while_its_prompt_is_tokenized_leaves_nothing_behind(service):
    ctx = zmq.Context()
    gone = ctx.socket(zmq.DEALER)
    gone.setsockopt(zmq.LINGER, 0)
    gone.connect(service.endpoint)
    gone.send(encode(Generate(id="gone", text=LARGE_FITTING,
                              params=SamplingParams(max_new_tokens=2000, ignore_eos=True))))
    gone.send(encode(Ping()))
    assert gone.poll(60_000)  # the service has the prompt
    gone.close()  # no pings from now on: its request is aborted after client_timeout_s
    ctx.term()
    deadline = time.monotonic() + 60  # client_timeout_s, and a step in progress
    while "silent" not in service.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "silent" in service.log_text() and "Traceback" not in service.log_text()
    with Client(service.endpoint) as client:
        assert_idle(client)
