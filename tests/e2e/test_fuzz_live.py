"""Fuzzed frames and bodies against a real service: each malformed ZMQ frame gets an `Error`
with the code the codec gives it, each HTTP body a 4xx in OpenAI's error shape (or, for one the
API takes, an answer), never a 5xx, a traceback or silence; afterwards a normal request is
answered on both transports and every page and slot is free again."""

from __future__ import annotations

import httpx2 as httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc.client import Client
from ipc.client_messages import Error
from ipc.codec import ProtocolError, decode_client_request, decode_service_reply
from ipc.sampling import SamplingParams
from service.http.errors import ApiError
from service.http.openai_params import decode_body, to_generates
from service.http.openai_types import ChatCompletionRequest, CompletionRequest
from tests.e2e.service_process import ServiceProcess, assert_idle
from tests.ipc.test_fuzz_decoders import client_frames
from tests.service.test_fuzz_http import FIELDS, VOCAB, json_values, messages, prompts

LIVE = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
PATHS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


@pytest.fixture(scope="module")
def svc(model_path):
    service = ServiceProcess(model_path)
    yield service
    service.stop()


@pytest.fixture(scope="module")
def dealer(svc):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.endpoint)
    yield sock
    sock.close()
    ctx.term()


@pytest.fixture(scope="module")
def served(svc):
    with httpx.Client(base_url=svc.http_url, timeout=60) as http:
        yield http, http.get("/v1/models").json()["data"][0]["id"]


@LIVE
@given(client_frames, st.booleans())
def test_a_malformed_frame_gets_the_error_the_codec_gives_it(dealer, frame, multipart):
    try:
        decode_client_request(frame)
        expected = "invalid_message" if multipart else None
    except ProtocolError as exc:
        expected = "invalid_message" if multipart else exc.code
    if expected is None:
        return  # a valid request: not this test's business
    dealer.send_multipart([frame, b"more"] if multipart else [frame])
    assert dealer.poll(10_000), f"no answer to {frame[:80]!r}"
    # The payload last: a message of frames that starts with an empty one is answered as a
    # REQ socket's, behind an empty delimiter frame.
    reply = decode_service_reply(dealer.recv_multipart()[-1])
    assert isinstance(reply, Error) and reply.code == expected, reply


def expected_status(body: bytes, kind: type, model: str) -> int | None:
    """What the API answers: a refusal's status, 200 for a short request it takes (one that
    the service may still refuse at admission with a 400), None for a long one (not sent)."""
    try:
        req = decode_body(body, kind)
        if req.model != model:
            return 404
        generates = to_generates(req, "id", 2048, VOCAB)
    except ApiError as exc:
        return exc.status
    return 200 if all(g.params.max_new_tokens <= 2 for g in generates) else None


@LIVE
@given(st.data())
def test_a_malformed_body_gets_a_4xx_in_openais_shape(served, data):
    http, model = served
    path = data.draw(st.sampled_from(list(PATHS)))
    kind = PATHS[path]
    # Often a valid prompt, so that the parameters are what the API refuses or takes.
    fields = dict(data.draw(st.sampled_from([{}, {"messages": [{"role": "user", "content": "Hi"}]}
                                             if kind is ChatCompletionRequest else {"prompt": "Hi"}])))
    fields |= data.draw(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5),
                                       st.one_of(json_values, messages, prompts), max_size=5))
    if data.draw(st.booleans()):  # short, so that one the API takes is answered quickly
        fields.update(max_tokens=1, n=1, stream=data.draw(st.booleans()))
        fields.pop("max_completion_tokens", None)
    body = msgspec.json.encode({"model": data.draw(st.sampled_from([model, "m"])), **fields})
    body = data.draw(st.sampled_from([body, body[:len(body) // 2]]))
    status = expected_status(body, kind, model)
    if status is None:
        return
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    if status == 200 and r.status_code == 400:  # refused at admission: an empty prompt, ...
        status = 400
    assert r.status_code == status, (body[:200], r.status_code, r.text[:300])
    if status != 200:
        error = r.json()["error"]
        assert error["message"] and error["code"] and error["type"], error


@pytest.mark.parametrize("body", [
    b'{"model": "M", "messages": [{"role": "user", "content": "\xff"}]}',
    b'{"model": "M", "tools": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
    ids=["invalid-utf8", "nested-too-deep"])
def test_bodies_msgspec_cannot_read_are_400s_not_500s(served, body):
    http, model = served
    r = http.post("/v1/chat/completions", content=body.replace(b"M", model.encode(), 1))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_after_the_fuzzing_the_service_serves_both_transports_and_is_idle(svc, served):
    http, model = served
    r = http.post("/v1/chat/completions", json={
        "model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text
    with Client(svc.endpoint) as client:
        assert client.complete("Hi", params=SamplingParams(max_new_tokens=3)).token_ids
        assert_idle(client)
        assert client.health().worker_alive
    log = svc.log_text()
    assert "Traceback" not in log and "internal_error" not in log, log[-3000:]
