"""Property-based fuzzing of the decoders of every ZMQ frame: a client's request (the service
decodes it), and the messages between the scheduler and the worker (each side decodes the
other's). Whatever the bytes, a decoder answers with its own error or a valid message:
never another exception, which would take down the loop that reads the socket.

The frames are arbitrary bytes, mutated valid frames, and msgpack that is structured but wrong:
the messages' own field names with values of every type, huge integers, NaN, strings that are
not UTF-8 and nesting deep enough to exhaust the decoder's recursion.
"""

from __future__ import annotations

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ipc.client_messages import ChatMessage, Generate
from ipc.codec import CLIENT_REQUEST_TYPES, ProtocolError, decode_client_request, encode
from ipc.sampling import SamplingParams
from ipc.worker_messages import (ExtendEntry, NewRequest, PageGrant, SchedulerToWorker,
                                 StepPlan, StepResult, WorkerFailed, WorkerInfo,
                                 WorkerToScheduler)
from ipc.zmq_util import SchedulerSideCodec, WorkerSideCodec

FUZZ = settings(max_examples=300, deadline=None)
PROTOCOL_ERROR_CODES = {"invalid_message", "invalid_params", "unknown_message_type",
                        "message_too_large"}

NOT_UTF8 = msgspec.Raw(b"\xa3\xff\xfe\xfd")  # a msgpack str whose 3 bytes are not UTF-8


def nested(depth: int) -> msgspec.Raw:
    """[[[...nil...]]], `depth` arrays deep, as raw msgpack."""
    return msgspec.Raw(b"\x91" * depth + b"\xc0")


def names_of(*types: type) -> list[str]:
    return sorted({f for t in types for f in t.__struct_fields__})


CLIENT_FIELDS = names_of(Generate, SamplingParams, ChatMessage) + ["type", "key", "extra"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
    st.text(max_size=16), st.binary(max_size=16), st.just(NOT_UTF8),
    st.sampled_from([10, 1_000, 200_000]).map(nested))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(CLIENT_FIELDS) | st.text(max_size=6), inner, max_size=4), max_leaves=10)
# Fields of the right shape more often than chance would give, so the checks behind the
# type decoding (ids, prompts, roles, sampling ranges) are reached too.
chat = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"]),
                                       "content": st.text(max_size=8) | values}), max_size=3)
params = st.dictionaries(st.sampled_from(names_of(SamplingParams)),
                         st.integers(-2**63, 2**64 - 1) | st.floats() | values, max_size=4)
field_values = st.one_of(values, chat, params, st.text(min_size=120, max_size=140),
                         st.lists(st.integers(-2**63, 2**64 - 1), max_size=4))
message_like = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(CLIENT_REQUEST_TYPES + ("chunk", "bogus")) | values,
    st.dictionaries(st.sampled_from(CLIENT_FIELDS), field_values, max_size=5))
VALID_FRAMES = [encode(Generate(id="r", text="hi", params=SamplingParams(stop=["x"]))),
                encode(Generate(id="r", messages=[ChatMessage("user", "hi")]))]
mutated = st.builds(lambda frame, at, byte: frame[:at % len(frame)] + bytes([byte])
                    + frame[at % len(frame) + 1:],
                    st.sampled_from(VALID_FRAMES), st.integers(0, 200), st.integers(0, 255))
truncated = st.builds(lambda frame, at: frame[:at % len(frame)], st.sampled_from(VALID_FRAMES),
                      st.integers(0, 200))
client_frames = st.one_of(st.binary(max_size=64), mutated, truncated,
                          (values | message_like).map(msgspec.msgpack.encode))


@FUZZ
@given(client_frames)
@example(msgspec.msgpack.encode({"type": "generate", "id": NOT_UTF8, "text": "x"}))
@example(msgspec.msgpack.encode({"type": "generate", "id": "a", "text": nested(200_000)}))
@example(msgspec.msgpack.encode({"type": "generate", "id": "a", "token_ids": [2**64 - 1]}))
def test_a_client_frame_decodes_to_a_valid_request_or_a_protocol_error(frame):
    try:
        msg = decode_client_request(frame)
    except ProtocolError as exc:
        assert exc.code in PROTOCOL_ERROR_CODES and exc.message, repr(exc)
        assert exc.to_error().message == exc.message
        return
    assert encode(decode_client_request(encode(msg))) == encode(msg)  # valid: it round-trips


@settings(max_examples=50, deadline=None)
@given(client_frames)
def test_a_frame_over_the_limit_is_refused_before_it_is_read(frame):
    try:
        decode_client_request(frame + b"\x00" * 1024, max_bytes=1023)
    except ProtocolError as exc:
        assert exc.code == "message_too_large"


def worker_frames(tags: list[str], fields: list[str]):
    """Messages of the worker protocol are msgpack arrays: [tag, field, field, ...]."""
    entry = st.lists(values | st.integers(-2**63, 2**64 - 1), max_size=5)
    wrong = st.builds(lambda tag, rest: [tag, *rest], st.sampled_from(tags) | values,
                      st.lists(values | st.lists(entry, max_size=2)
                               | st.dictionaries(st.sampled_from(fields), values, max_size=3),
                               max_size=11))
    return st.one_of(st.binary(max_size=64), (values | wrong).map(msgspec.msgpack.encode))


def check_pair_decoder(codec, frame: bytes, union) -> None:
    try:
        msg = codec.decode(frame)
    except msgspec.DecodeError:
        return
    assert isinstance(msg, union.__args__)


@FUZZ
@given(worker_frames(["result", "ready", "failed"], names_of(StepResult, WorkerInfo)))
@example(msgspec.msgpack.encode(["failed", None, NOT_UTF8]))
@example(msgspec.msgpack.encode(["failed", None, nested(200_000)]))
def test_a_worker_frame_decodes_to_a_worker_message_or_a_decode_error(frame):
    check_pair_decoder(SchedulerSideCodec(), frame, WorkerToScheduler)


@FUZZ
@given(worker_frames(["plan", "shutdown"], names_of(
    StepPlan, NewRequest, PageGrant, ExtendEntry, SamplingParams, WorkerFailed)))
@example(msgspec.msgpack.encode([NOT_UTF8]))
def test_a_scheduler_frame_decodes_to_a_plan_or_a_decode_error(frame):
    check_pair_decoder(WorkerSideCodec(), frame, SchedulerToWorker)
