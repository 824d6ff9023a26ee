"""The client-protocol codec: round trips, the wire shape another language sees, and every class
of bad frame giving its error code and a message that names the problem."""

import msgspec
import pytest

from ipc.client_messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    ChatMessage,
    Chunk,
    Error,
    Finished,
    Generate,
    Health,
    Ping,
    Pong,
    Stats,
    Usage,
)
from ipc.codec import (
    MAX_NESTING,
    MAX_REQUEST_ID_CHARS,
    ProtocolError,
    decode_client_request,
    decode_service_reply,
    encode,
)
from ipc.sampling import SamplingParams

# Frames as a client in another language would build them: plain msgpack maps.
pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

CLIENT_MESSAGES = [
    Generate(id="a", text="hello"),
    Generate(id="b", token_ids=[1, 2, 3], stream=False,
             params=SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                   repetition_penalty=1.1, frequency_penalty=0.5,
                                   presence_penalty=-0.5, seed=42, logprobs=3,
                                   max_new_tokens=17, min_new_tokens=2, stop=["\n\n"],
                                   stop_token_ids=[2], ignore_eos=True)),
    Generate(id="c", messages=[ChatMessage("system", "be brief"), ChatMessage("user", "hi")]),
    Abort(id="a"),
    Health(),
    Ping(),
]
SERVICE_REPLIES = [
    Chunk(id="a", token_ids=[5, 6], text="hi there"),
    Chunk(id="a", token_ids=[5], text="x", logprobs=[-0.25], top_logprobs=[[(5, -0.25), (9, -2.0)]]),
    Finished(id="a", reason="stop", usage=Usage(prompt_tokens=4, completion_tokens=2,
                                                 ttft_ms=1.5, e2e_ms=9.0)),
    Error(id="a", code="invalid_params", message="bad"),
    Error(id=None, code="invalid_message", message="bad frame"),
    Stats(model="m", device="cpu", worker_alive=True, running=1, waiting=2, free_pages=3,
          total_pages=4, free_slots=5, total_slots=6, steps=7, output_tokens=8),
    Pong(),
]


def error_of(frame: bytes, decode=decode_client_request) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    return info.value


# ----- round trips and wire shape ------------------------------------------------------------

@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda m: type(m).__name__)
def test_client_request_round_trip(msg):
    assert decode_client_request(encode(msg)) == msg


@pytest.mark.parametrize("msg", SERVICE_REPLIES, ids=lambda m: type(m).__name__)
def test_service_reply_round_trip(msg):
    assert decode_service_reply(encode(msg)) == msg


def test_wire_shape_is_a_tagged_msgpack_map():
    """What docs/protocol.md promises a non-Python client: a map with a "type" tag and named
    fields; a hand-built map decodes to the same message."""
    wire = unpack(encode(Generate(id="r1", text="hi", params=SamplingParams(temperature=0))))
    assert wire["type"] == "generate" and wire["id"] == "r1" and wire["text"] == "hi"
    assert wire["params"]["temperature"] == 0

    frame = pack({"type": "generate", "id": "r1", "text": "hi", "params": {"temperature": 0}})
    assert decode_client_request(frame) == Generate(id="r1", text="hi",
                                                    params=SamplingParams(temperature=0.0))
    # null for an absent optional field, as many msgpack libraries write it
    frame = pack({"type": "generate", "id": "r2", "text": None, "token_ids": [1],
                  "messages": None})
    assert decode_client_request(frame) == Generate(id="r2", token_ids=[1])
    assert unpack(encode(Pong())) == {"type": "pong"}
    chunk = unpack(encode(Chunk(id="a", token_ids=[1], text="x")))
    assert chunk["type"] == "chunk" and chunk["token_ids"] == [1]


def test_protocol_error_becomes_an_error_reply():
    err = ProtocolError("invalid_params", "temperature is bad", "r9")
    assert decode_service_reply(encode(err.to_error())) == Error(
        id="r9", code="invalid_params", message="temperature is bad")


# ----- bad frames ----------------------------------------------------------------------------

def test_oversize_frame_is_refused_before_decoding():
    # Not msgpack at all: the size check must come first.
    err = error_of(b"\xc1" * (MAX_MESSAGE_BYTES + 1))
    assert err.code == "message_too_large"
    assert str(MAX_MESSAGE_BYTES) in err.message and str(MAX_MESSAGE_BYTES + 1) in err.message
    # A valid Generate just over a custom limit
    frame = encode(Generate(id="a", text="x" * 100))
    assert error_of(frame, lambda f: decode_client_request(f, max_bytes=50)).code == \
        "message_too_large"
    assert decode_client_request(frame, max_bytes=len(frame)).text == "x" * 100
    assert error_of(frame, lambda f: decode_client_request(f, max_bytes=50)).request_id == "a"


# msgspec raises UnicodeDecodeError for a str that is not UTF-8 and RecursionError for nesting
# too deep: both used to escape the codec and end the service.
BAD_UTF8 = b"\x83\xa4type\xa8generate\xa2id\xa1x\xa4text\xa3\xed\xa0\x80"  # a lone surrogate
DEEP = b"\x83\xa4type\xa8generate\xa2id\xa1x\xa4text" + b"\x91" * 100_000 + b"\xc0"


@pytest.mark.parametrize("frame, request_id", [
    (b"\xc1", None), (b"", None), (pack({"type": "ping"}) + b"x", None), (b"\x92\x01", None),
    pytest.param(BAD_UTF8, "x", id="text-not-utf8"),
    pytest.param(b"\x83\xa4type\xa8generate\xa4text\xa3\xed\xa0\x80\xa2id\xa1x", "x",
                 id="id-after-bad-text"),
    pytest.param(b"\x83\xa4type\xa8generate\xa2id\xa3\xed\xa0\x80\xa4text\xa1x", None,
                 id="id-not-utf8"),
    pytest.param(b"\x81\xa4type\xa2\xff\xfe", None, id="type-not-utf8"),
    pytest.param(b"\x82\xa4type\xa4ping\xa2id\xa3\xed\xa0\x80", None, id="ping-has-no-id"),
])
def test_not_msgpack(frame, request_id):
    """The error carries the request id whenever the frame's top-level map shows one."""
    err = error_of(frame)
    assert err.code == "invalid_message"
    assert "not valid msgpack" in err.message
    assert err.request_id == request_id


@pytest.mark.parametrize("frame, request_id", [
    pytest.param(DEEP, "x", id="deep-text"),
    pytest.param(b"\x83\xa4type\xa8generate\xa4text" + b"\x91" * 100_000 + b"\xc0\xa2id\xa1x",
                 "x", id="id-after-deep-text"),
    pytest.param(b"\x91" * 100_000 + b"\xc0", None, id="deep"),
])
def test_nesting_too_deep_is_refused_with_the_request_id(frame, request_id):
    err = error_of(frame)
    assert err.code == "invalid_message"
    assert f"more than {MAX_NESTING} deep" in err.message
    assert err.request_id == request_id


def nested_generate(depth: int) -> bytes:
    """A Generate whose prompt sits `depth` containers deep (the map itself is the first)."""
    return b"\x83\xa4type\xa8generate\xa2id\xa1x\xa4text" + b"\x91" * (depth - 1) + b"\xa1t"


def recursing(levels: int, fn):
    return fn() if levels == 0 else recursing(levels - 1, fn)


def test_the_nesting_limit_is_the_same_at_any_stack_depth():
    """msgspec's own limit shrinks as the caller's stack grows, which once made the service and
    a test disagree about one frame: the codec's limit comes first and does not move."""
    for stack in (0, 500):
        ok = error_of(nested_generate(MAX_NESTING), lambda f: recursing(stack, lambda: (
            decode_client_request(f))))
        assert "more than" not in ok.message  # refused for its type, not its depth
        deep = error_of(nested_generate(MAX_NESTING + 1), lambda f: recursing(stack, lambda: (
            decode_client_request(f))))
        assert f"more than {MAX_NESTING} deep" in deep.message


def test_unknown_type_lists_valid_types():
    err = error_of(pack({"type": "generat", "id": "a", "text": "x"}))
    assert err.code == "unknown_message_type"
    assert "'generat'" in err.message
    for tag in ("generate", "abort", "health", "ping"):
        assert tag in err.message
    err = error_of(pack({"type": "gibberish"}), decode_service_reply)
    assert err.code == "unknown_message_type" and "finished" in err.message


def test_missing_type_and_non_map():
    err = error_of(pack({"id": "a", "text": "x"}))
    assert err.code == "invalid_message" and '"type"' in err.message
    err = error_of(pack([1, 2, 3]))
    assert err.code == "invalid_message" and "map" in err.message


def test_wrong_field_type_names_the_path_and_recovers_the_id():
    frame = pack({"type": "generate", "id": "req-7", "text": "hi",
                  "params": {"temperature": "hot"}})
    err = error_of(frame)
    assert err.code == "invalid_message"
    assert "$.params.temperature" in err.message and "float" in err.message
    assert err.request_id == "req-7"  # the error can be addressed to the request
    assert err.to_error().id == "req-7"


def test_unknown_field_is_refused():
    err = error_of(pack({"type": "generate", "id": "r", "text": "hi", "temprature": 0.5}))
    assert err.code == "invalid_message" and "temprature" in err.message
    assert err.request_id == "r"
    err = error_of(pack({"type": "generate", "id": "r", "text": "hi",
                         "params": {"top_n": 3}}))
    assert "top_n" in err.message and "$.params" in err.message


def test_missing_required_field():
    err = error_of(pack({"type": "abort"}))
    assert err.code == "invalid_message" and "`id`" in err.message
    assert err.request_id is None
    err = error_of(pack({"type": "chunk", "id": "a", "text": "x"}), decode_service_reply)
    assert "token_ids" in err.message and err.request_id == "a"


def test_id_of_wrong_type_is_not_recovered():
    err = error_of(pack({"type": "generate", "id": 12, "text": "hi"}))
    assert err.code == "invalid_message" and "$.id" in err.message
    assert err.request_id is None


# ----- Generate semantics --------------------------------------------------------------------

@pytest.mark.parametrize("fields, needle", [
    ({}, "none was given"),
    ({"text": ""}, "none was given"),
    ({"token_ids": [], "messages": []}, "none was given"),
    ({"text": "a", "token_ids": [1]}, "text and token_ids were given"),
    ({"text": "a", "messages": [{"role": "user", "content": "b"}]}, "text and messages"),
])
def test_exactly_one_prompt(fields, needle):
    err = error_of(pack({"type": "generate", "id": "g1", **fields}))
    assert err.code == "invalid_message" and needle in err.message
    assert err.request_id == "g1"


def test_chat_roles():
    frame = pack({"type": "generate", "id": "g", "messages": [
        {"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]})
    err = error_of(frame)
    assert err.code == "invalid_message"
    assert "messages[1].role" in err.message and "robot" in err.message
    assert "assistant" in err.message


def test_negative_token_id():
    err = error_of(pack({"type": "generate", "id": "g", "token_ids": [3, -1]}))
    assert err.code == "invalid_message" and "-1" in err.message


@pytest.mark.parametrize("params, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 2**64 - 1, "min_new_tokens": 2**63}, "max_new_tokens"),  # int64
    ({"logprobs": 99}, "logprobs"),
    ({"stop": [""]}, "stop"),
    # Bounded: stop conditions are checked per token on the loop every client shares.
    ({"stop": [f"s{i}" for i in range(65)]}, "at most 64 stop strings"),
    ({"stop": ["x" * 513]}, "at most 512 characters"),
    ({"stop_token_ids": list(range(257))}, "at most 256 stop token ids"),
])
def test_invalid_params(params, field):
    err = error_of(pack({"type": "generate", "id": "p1", "text": "x", "params": params}))
    assert err.code == "invalid_params"
    assert field in err.message and err.request_id == "p1"


@pytest.mark.parametrize("tag", ["generate", "abort"])
def test_request_id_rules(tag):
    extra = {"text": "x"} if tag == "generate" else {}
    err = error_of(pack({"type": tag, "id": "", **extra}))
    assert err.code == "invalid_message" and "non-empty" in err.message
    long_id = "x" * (MAX_REQUEST_ID_CHARS + 1)
    err = error_of(pack({"type": tag, "id": long_id, **extra}))
    assert err.code == "invalid_message" and str(MAX_REQUEST_ID_CHARS) in err.message
    ok_id = "x" * MAX_REQUEST_ID_CHARS
    assert decode_client_request(pack({"type": tag, "id": ok_id, **extra})).id == ok_id


# ----- telemetry: newer fields stay readable both ways -------------------------------------

class _OldRequestTelemetry(msgspec.Struct, array_like=True, frozen=True):
    """RequestTelemetry before `text_tail`: what an older monitor decodes with."""

    id: str
    slot: int
    state: str
    prompt_len: int
    seq_len: int
    generated: int
    last_accept_len: int
    age_s: float
    key: str
    accept_length: float | None = None


def test_request_telemetry_text_tail_is_compatible_both_ways():
    from ipc.telemetry import RequestTelemetry

    new = RequestTelemetry("r", 1, "decoding", 3, 5, 2, 0, 0.5, "ab/r", None, "Hello, wo")
    wire = pack(new)
    assert unpack(wire)[10] == "Hello, wo"  # array_like: the text after the older fields
    assert unpack(wire)[-1] == 0  # then the replica, newest last
    old = msgspec.msgpack.decode(wire, type=_OldRequestTelemetry)  # an older monitor
    assert (old.id, old.key, old.generated) == ("r", "ab/r", 2)
    # An older service sends no text: the newer monitor reads None ("not published").
    from_old = msgspec.msgpack.decode(pack(_OldRequestTelemetry(
        "r", 1, "decoding", 3, 5, 2, 0, 0.5, "ab/r")), type=RequestTelemetry)
    assert from_old.text_tail is None and from_old.key == "ab/r"


def test_snapshot_spec_config_is_optional():
    from ipc.telemetry import SpecConfigTelemetry, TelemetrySnapshot, WorkerTelemetry

    base = dict(time=1.0, uptime_s=2.0, model="m", overlap=True, speculation=True,
                running=[], waiting=[], free_pages=1, total_pages=2, page_size=16,
                free_slots=1, total_slots=2, output_tokens_per_s=0.0,
                total_output_tokens=0, finished_requests=0, retractions=0, recent_steps=[],
                worker_idle_share=0.0,
                worker=WorkerTelemetry(True, 1, 0, "cpu", "fp32", "torch"))
    snap = TelemetrySnapshot(**base, spec_config=SpecConfigTelemetry("eagle3", 4, 1, 5, 8))
    wire = unpack(pack(snap))
    assert wire["spec_config"] == {"algorithm": "eagle3", "num_steps": 4, "topk": 1,
                                   "num_draft_tokens": 5, "disable_above_batch_size": 8}
    assert msgspec.msgpack.decode(pack(snap), type=TelemetrySnapshot) == snap
    del wire["spec_config"]["disable_above_batch_size"]  # a service from before the setting
    old = msgspec.msgpack.decode(pack(wire), type=TelemetrySnapshot).spec_config
    assert old == SpecConfigTelemetry("eagle3", 4, 1, 5) and old.disable_above_batch_size == 0
    del wire["spec_config"]  # an older service
    assert msgspec.msgpack.decode(pack(wire), type=TelemetrySnapshot).spec_config is None
