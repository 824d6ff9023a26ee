"""The OpenAI-compatible HTTP API: a real `fmserve serve` on free ports, driven by the official
`openai` package, raw `httpx2` for what that client cannot send, and Prometheus' own parser."""

from __future__ import annotations

import socket
import time

import httpx2 as httpx
import msgspec
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from ipc.client import Client
from ipc.client_messages import Abort, Generate
from ipc.codec import encode
from ipc.sampling import SamplingParams
from ipc.telemetry import TelemetrySnapshot
from service.tokenizer import TextTokenizer
from tests.e2e.service_process import ServiceProcess, assert_idle

KEY = "test-key"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def service(model_path):
    svc = ServiceProcess(model_path, "--api-key", KEY, "--set", "http.max_body_bytes=262144",
                         "--set", "scheduling.max_queued_requests=2",
                         "--set", "service.drain_timeout_s=0")  # the last test: no drain
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def api(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=service.http_url + "/v1", api_key=KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(api) -> str:
    (entry,) = api.models.list().data
    return entry.id


def metrics(service) -> dict[str, float]:
    text = httpx.get(service.http_url + "/metrics").text
    return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_greedy_chat_over_http_equals_the_same_request_over_zmq(service, api, model):
    with Client(service.endpoint) as client:
        zmq = client.complete(messages=CHAT, params=SamplingParams(temperature=0.0,
                                                                  max_new_tokens=24))
    r = api.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=24)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == zmq.text
    assert r.choices[0].finish_reason == zmq.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        zmq.usage.prompt_tokens, zmq.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_adds_up_to_the_whole_answer_and_ends_with_usage(api, model):
    whole = api.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                        max_completion_tokens=16)
    chunks = list(api.chat.completions.create(
        model=model, messages=CHAT, temperature=0, max_completion_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_take_several_prompts_token_ids_and_n(api, model, model_path):
    r = api.completions.create(model=model, prompt=["The sky is", "One, two,"], n=2,
                               max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n alike
    assert by_index[0] != by_index[2]
    tokenizer = TextTokenizer.from_model_path(model_path)
    ids = tokenizer.encode("The sky is")
    again = api.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert again.choices[0].text == by_index[0]
    prompt_tokens = len(ids) + len(tokenizer.encode("One, two,"))
    assert r.usage.prompt_tokens == prompt_tokens  # each prompt once, not once per answer
    assert r.usage.completion_tokens == 4 * 6


def test_stop_strings_end_the_answer_before_the_stop(api, model):
    free = api.completions.create(model=model, prompt="Count: 1, 2, 3, 4,", max_tokens=12,
                                  temperature=0).choices[0]
    stop = free.text.strip()[2:4] or ","  # a piece of what greedy decoding writes
    cut = api.completions.create(model=model, prompt="Count: 1, 2, 3, 4,", max_tokens=12,
                                 temperature=0, stop=[stop, "never-there"]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert free.text.startswith(cut.text)


def test_a_seed_makes_sampling_reproducible(api, model):
    def sample(seed: int) -> list[str]:
        r = api.chat.completions.create(model=model, messages=CHAT, temperature=1.0, seed=seed,
                                        max_tokens=24, n=2)
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    first = sample(7)
    assert sample(7) == first
    assert first[0] != first[1]  # answer i samples with seed + i
    assert sample(8) != first


def test_logprobs_in_chat_and_completions_formats(api, model):
    r = api.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=5,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)  # greedy
    c = api.completions.create(model=model, prompt="The sky is", temperature=0, max_tokens=4,
                               logprobs=2).choices[0]
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 4
    assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
    assert c.logprobs.text_offset[0] == 0 and "".join(c.logprobs.tokens) == c.text


def test_refusals_are_openai_errors_with_the_parameter_named(service, api, model):
    cases = [dict(tools=[{"type": "function", "function": {"name": "f"}}]),
             dict(response_format={"type": "json_object"}), dict(temperature=-1),
             dict(max_tokens=0), dict(top_logprobs=3), dict(extra_body={"no_such_field": 1}),
             dict(messages=[{"role": "user", "content": [{"type": "image_url",
                                                           "image_url": {"url": "x"}}]}]),
             dict(logprobs=True, top_logprobs=50), dict(seed=2**64), dict(n=0)]
    params = ["tools", "response_format", "temperature", "max_tokens", "top_logprobs",
              None, "messages[0].content", "top_logprobs", "seed", "n"]
    for case, param in zip(cases, params):
        kwargs = dict(model=model, messages=CHAT, max_tokens=4) | case
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(**kwargs)
        assert err.value.status_code == 400
        body = err.value.body
        assert body["type"] == "invalid_request_error" and body["message"], case
        if param:
            assert body["param"] == param, (case, body)
    for case, sent in [(dict(logprobs=True, top_logprobs=50), "top_logprobs=50"),
                       (dict(seed=2**64), f"seed={2**64}"), (dict(n=0), "n=0"),
                       (dict(extra_body={"min_tokens": 10}), "max_tokens=4")]:
        with pytest.raises(openai.BadRequestError) as err:  # the message names what was sent
            api.chat.completions.create(model=model, messages=CHAT, max_tokens=4, **case)
        message = err.value.body["message"]
        assert sent in message and "n must" not in message and "_new_" not in message, message
    with pytest.raises(openai.NotFoundError) as err:
        api.chat.completions.create(model="no-such-model", messages=CHAT)
    assert err.value.body["code"] == "model_not_found" and model in err.value.body["message"]
    wrong = openai.OpenAI(base_url=service.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=model, messages=CHAT)


def test_a_prompt_longer_than_the_context_is_a_400_that_says_so(api, model):
    """A text over 64 KB is tokenized off the event loop, so its length is found after
    admission and comes back as the request's Error reply: a 400 naming the prompt's and the
    context's lengths, not a 500 (the reply's error once left the disconnect watch's task group
    wrapped in an ExceptionGroup)."""
    text = "word " * 20_000  # 100 KB: tokenized on a thread (service/prompt_intake.py)
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                    max_tokens=4)
    body = err.value.body
    assert body["code"] == "prompt_too_long" and "the context holds" in body["message"], body
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model, prompt=text, max_tokens=4)
    assert err.value.body["code"] == "prompt_too_long"
    r = api.chat.completions.create(model=model, messages=CHAT, max_tokens=4)  # still serving
    assert r.choices[0].message.content


def test_malformed_bodies_unknown_paths_and_open_health(service, model):
    url, auth = service.http_url, {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url + "/v1/completions", headers=auth,
                   json={"model": "m", "prompt": "x", "max_tokens": "ten"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url + "/v1/completions", headers=auth, json={"model": model, "prompt": [[]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/v1/completions", headers=auth,
                   json={"model": "m", "prompt": "x" * 270000})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/nowhere", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(url + "/v1/chat/completions", headers=auth)  # the client's mistake, a 405
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(url + "/v1/chat/completions", json={}).status_code == 401  # key first
    health = httpx.get(url + "/health")  # open without a key
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_metrics_move_by_what_a_known_request_did(service, api, model):
    before = metrics(service)
    r = api.completions.create(model=model, prompt="The sky is", max_tokens=7, temperature=0)
    after = metrics(service)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    assert delta("fmserve:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("fmserve:generation_tokens_total") == 7
    assert delta('fmserve:request_success_total{length}') == 1
    assert delta("fmserve:time_to_first_token_seconds_count") == 1
    assert delta("fmserve:e2e_request_latency_seconds_count") == 1
    assert delta("fmserve:inter_token_latency_seconds_count") == 6
    assert after["fmserve:num_requests_running"] == 0
    assert after['fmserve:worker_state{ready}'] == 1


def test_a_client_leaving_mid_stream_frees_its_slot_and_pages_at_once(service, model):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with zmq.Context() as ctx, ctx.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{service.tport}")
        with httpx.stream("POST", service.http_url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = msgspec.json.decode(next(lines).removeprefix("data: "))
            shown = set()  # `fmserve top` shows the HTTP request by its id, as any other
            while f"{first['id']}-0" not in shown:
                assert sub.poll(5000), "no telemetry"
                snap = msgspec.msgpack.decode(sub.recv(), type=TelemetrySnapshot)
                shown = {req.id for req in snap.running}
    with Client(service.endpoint) as client:
        assert_idle(client)  # within seconds, not after 2000 tokens


def test_a_full_queue_is_a_429(service, api, model):
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    with Client(service.endpoint) as client, zmq.Context() as ctx, \
            ctx.socket(zmq.DEALER) as sock:
        sock.connect(service.endpoint)
        for i in range(10):  # 8 slots run, 2 may wait: 10 fill the queue
            sock.send(encode(Generate(str(i), text="Once", params=params)))
        deadline = time.monotonic() + 30
        while (h := client.health()).waiting < 2 or h.free_slots:  # 8 run, 2 wait
            assert time.monotonic() < deadline, client.health()
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as err:
            api.completions.create(model=model, prompt="x", max_tokens=2)
        assert err.value.body["code"] == "queue_full"
        for i in range(10):
            sock.send(encode(Abort(str(i))))
        assert_idle(client)


def test_shutdown_ends_an_open_stream_with_an_error_event(service, model):
    # Last: it stops the module's service.
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", service.http_url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        assert service.stop() == 0
        rest = [line for line in lines if line]
    assert '"code":"service_shutdown"' in rest[-2] and rest[-1] == "data: [DONE]"
    with socket.socket() as s:  # the port is closed
        assert s.connect_ex(("127.0.0.1", service.http_port)) != 0
