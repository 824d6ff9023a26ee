"""Property-based fuzzing of the OpenAI API's request bodies: whatever the bytes, a body gives
the service's Generate messages with valid sampling parameters, or an ApiError whose status is
a 4xx (never a 500). The prompts themselves are checked when the service admits the requests
(an empty or out-of-vocabulary prompt is a 400 there: tests/e2e/test_fuzz_live.py)."""

from __future__ import annotations

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ipc.client_messages import Generate
from service.http.errors import ApiError
from service.http.openai_params import decode_body, to_generates
from service.http.openai_types import (ChatCompletionRequest, ChatMessageIn, CompletionRequest,
                                       StreamOptions, TextPart)

VOCAB = 49152
MAX_TOKENS = 2048
NOT_UTF8 = msgspec.Raw(b'"\xff\xfe"')
KINDS = (ChatCompletionRequest, CompletionRequest)


def nested(depth: int) -> msgspec.Raw:
    return msgspec.Raw(b"[" * depth + b"]" * depth)


FIELDS = sorted({f for t in (*KINDS, ChatMessageIn, StreamOptions, TextPart)
                 for f in t.__struct_fields__})
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False), st.text(max_size=10), st.just(NOT_UTF8),
                    st.sampled_from([10, 200_000]).map(nested))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=5), inner, max_size=3), max_leaves=8)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]) | json_values},
    optional={"content": st.text(max_size=8) | json_values, "name": json_values}), max_size=3)
prompts = st.one_of(st.text(max_size=8), st.lists(st.integers(-2, VOCAB + 2), max_size=3),
                    st.lists(st.text(max_size=4), max_size=3), json_values)
bodies = st.builds(
    lambda model, fields: msgspec.json.encode({**model, **fields}),
    st.sampled_from([{"model": "m"}, {}]) | st.dictionaries(st.just("model"), json_values),
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5),
                    st.one_of(json_values, messages, prompts), max_size=5))
http_bodies = st.one_of(bodies, st.binary(max_size=40))


def generates_or_api_error(body: bytes, kind: type) -> list | ApiError:
    try:
        return to_generates(decode_body(body, kind), "id", MAX_TOKENS, VOCAB)
    except ApiError as exc:
        return exc


@settings(max_examples=400, deadline=None)
@given(http_bodies, st.sampled_from(KINDS))
@example(b'{"model": "m", "messages": [{"role": "user", "content": "\xff"}]}',
         ChatCompletionRequest)  # invalid UTF-8 was a 500
@example(b'{"model": "m", "tools": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         ChatCompletionRequest)  # and so was nesting too deep for msgspec
def test_any_body_gives_requests_or_a_4xx_api_error(body, kind):
    out = generates_or_api_error(body, kind)
    if isinstance(out, ApiError):
        assert 400 <= out.status < 500 and out.message, (out.code, out.message)
        assert msgspec.json.decode(out.response().body)["error"]["code"] == out.code
        return
    assert out
    for msg in out:
        assert isinstance(msg, Generate)
        msg.params.validate(VOCAB)
