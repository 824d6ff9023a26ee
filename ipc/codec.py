"""msgpack codec for the client protocol, with errors a person can act on.

One frame is one msgpack map with a "type" tag (see docs/protocol.md). Decoding a client
request never raises anything but `ProtocolError`, whose `code` is the `Error.code` the service
answers with and whose `request_id` is the request the error belongs to when it could be
recovered from a malformed frame (so a client sees its own request fail, not an orphan error).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.client_messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    ClientRequest,
    Error,
    Generate,
    ServiceReply,
)
from ipc.frame_head import frame_head, nests_deeper_than

MAX_REQUEST_ID_CHARS = 128
# The deepest a frame may nest (a protocol message needs 4): checked before msgspec, whose own
# limit depends on the caller's stack, so a frame is refused the same way in every process.
MAX_NESTING = 32
CHAT_ROLES = ("system", "user", "assistant")

# Tags a frame may carry, in the order the docs list them.
CLIENT_REQUEST_TYPES = ("generate", "abort", "health", "ping", "admin_abort")
SERVICE_REPLY_TYPES = ("chunk", "finished", "error", "stats", "pong", "aborted")
_TYPES_WITH_ID = ("generate", "abort", "chunk", "finished", "error")

# Encoders/decoders are cached: building one compiles the type's schema.
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ClientRequest)
_reply_decoder = msgspec.msgpack.Decoder(ServiceReply)
_lenient_decoder = msgspec.msgpack.Decoder()  # any msgpack -> Python objects
# What msgspec raises for a frame it cannot read: besides DecodeError, a str that is not UTF-8
# gives UnicodeDecodeError and nesting too deep RecursionError (either crashed the service).
UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


class ProtocolError(ValueError):
    """A frame or request that breaks the protocol. `code` is the wire `Error.code`."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def to_error(self) -> Error:
        """The reply the service sends for this error."""
        return Error(id=self.request_id, code=self.code, message=self.message)

    def __repr__(self) -> str:
        return (f"ProtocolError(code={self.code!r}, message={self.message!r}, "
                f"request_id={self.request_id!r})")


def _invalid(message: str, request_id: str | None = None) -> ProtocolError:
    return ProtocolError("invalid_message", message, request_id)


def encode(msg: Any) -> bytes:
    """One message (any protocol Struct) -> one frame."""
    return _encoder.encode(msg)


def decode_client_request(frame: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> ClientRequest:
    """Frame from a client -> message; a `Generate` is also checked with `check_generate`."""
    msg = _decode(frame, _request_decoder, CLIENT_REQUEST_TYPES, "client request", max_bytes)
    if isinstance(msg, Generate):
        check_generate(msg)
    elif isinstance(msg, Abort):
        _check_request_id(msg.id)
    return msg


def decode_service_reply(frame: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> ServiceReply:
    """Frame from the service -> message (used by clients)."""
    return _decode(frame, _reply_decoder, SERVICE_REPLY_TYPES, "service reply", max_bytes)


def check_generate(msg: Generate) -> None:
    """Checks a decoded `Generate` cannot express in types; raises `ProtocolError`.

    The vocabulary size is not known here: the service checks token ids and top_k against
    it when the request is admitted.
    """
    _check_request_id(msg.id)
    rid = msg.id
    given = [name for name in ("text", "token_ids", "messages") if getattr(msg, name)]
    if len(given) != 1:
        what = "none was" if not given else f"{' and '.join(given)} were"
        raise _invalid(f"request {rid!r}: give exactly one non-empty prompt field of text, "
                       f"token_ids or messages; {what} given", rid)
    if msg.token_ids:
        bad = [t for t in msg.token_ids if t < 0]
        if bad:
            raise _invalid(f"request {rid!r}: token_ids must be >= 0, got {bad[0]}", rid)
    if msg.messages:
        for i, m in enumerate(msg.messages):
            if m.role not in CHAT_ROLES:
                raise _invalid(f"request {rid!r}: messages[{i}].role is {m.role!r}; "
                               f"it must be one of {', '.join(CHAT_ROLES)}", rid)
    try:
        msg.params.validate()
    except ValueError as exc:
        raise ProtocolError("invalid_params", f"request {rid!r}: {exc}", rid) from None


def _check_request_id(rid: str) -> None:
    if not rid:
        raise _invalid("request id must be a non-empty string")
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise _invalid(f"request id {rid[:32]!r}... is {len(rid)} characters long; "
                       f"the limit is {MAX_REQUEST_ID_CHARS}")


def _decode(frame: bytes, decoder: msgspec.msgpack.Decoder, valid_types: tuple[str, ...],
            what: str, max_bytes: int):
    # Size first: a huge frame is refused before we spend time parsing it (its id is read by
    # item sizes, not by decoding it).
    if len(frame) > max_bytes:
        raise ProtocolError("message_too_large",
                            f"{what} frame is {len(frame)} bytes; the limit is {max_bytes} bytes",
                            _id_in(frame))
    if nests_deeper_than(frame, MAX_NESTING):
        raise _invalid(f"{what} frame nests containers more than {MAX_NESTING} deep; protocol "
                       f"messages need 4 at most", _id_in(frame))
    try:
        return decoder.decode(frame)
    except msgspec.ValidationError as exc:  # first: it is a subclass of DecodeError
        error = exc
    except UNREADABLE as exc:
        raise _not_msgpack(exc, frame) from None
    # The typed decoder may stop at the first type mismatch, before it has read the whole
    # frame: parse it untyped to tell bad msgpack from a bad message and to find the id.
    try:
        raw = _lenient_decoder.decode(frame)
    except UNREADABLE as exc:
        raise _not_msgpack(exc, frame) from None
    raise _explain_invalid(raw, error, valid_types, what)


def _not_msgpack(exc: Exception, frame: bytes) -> ProtocolError:
    why = f"a str in it is not valid UTF-8: {exc}" if isinstance(exc, UnicodeDecodeError) \
        else str(exc)
    return _invalid(f"frame is not valid msgpack ({why}); each frame must be one msgpack map "
                    f"with a \"type\" field", _id_in(frame))


def _id_in(frame: bytes) -> str | None:
    """The request id of a frame msgspec cannot (or should not) decode, when it can be read."""
    head = frame_head(frame)
    return _request_id(head.get("type"), head.get("id"))


def _request_id(tag: Any, rid: Any) -> str | None:
    """The id an error about a frame of type `tag` belongs to, if it is a valid one."""
    ok = tag in _TYPES_WITH_ID and isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID_CHARS
    return rid if ok else None


def _explain_invalid(raw: Any, exc: msgspec.ValidationError,
                     valid_types: tuple[str, ...], what: str) -> ProtocolError:
    """The frame is msgpack but not a valid message: say which rule it breaks, and recover
    the request id when the frame has one so the error reaches the right request."""
    valid = ", ".join(valid_types)
    if not isinstance(raw, dict):
        return _invalid(f"{what} must be a msgpack map with a \"type\" field, "
                        f"got {type(raw).__name__}")
    tag = raw.get("type")
    if "type" not in raw:
        return _invalid(f"{what} has no \"type\" field; valid types are: {valid}")
    if tag not in valid_types:
        return ProtocolError("unknown_message_type",
                             f"unknown message type {tag!r}; valid types are: {valid}")
    return _invalid(f"invalid {tag!r} message: {exc}", _request_id(tag, raw.get("id")))
