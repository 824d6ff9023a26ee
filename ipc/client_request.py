"""A client request before it is sent (`build_generate`, `encode_generate`) and after it
ended (`Completion`), with the client's default settings."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ipc.client_errors import RequestFailed
from ipc.client_messages import ChatMessage, Generate, Usage
from ipc.codec import ProtocolError, check_generate, encode
from ipc.sampling import SamplingParams

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_HEALTH_TIMEOUT_S = 5.0
DEFAULT_SERVICE_TIMEOUT_S = 30.0


@dataclass
class Completion:
    """A finished request, collected by `complete()`."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    usage: Usage
    logprobs: list[float] | None = None


def build_generate(prompt: str | None = None, *, messages: list[Any] | None = None,
                   token_ids: list[int] | None = None, params: SamplingParams | None = None,
                   request_id: str | None = None, stream: bool = True) -> Generate:
    """A checked `Generate`; raises `RequestFailed` with the code the service would send."""
    chat = None
    if messages is not None:
        chat = [m if isinstance(m, ChatMessage) else ChatMessage(**m) for m in messages]
    msg = Generate(id=request_id if request_id is not None else uuid.uuid4().hex,
                   text=prompt, token_ids=None if token_ids is None else list(token_ids),
                   messages=chat, params=params if params is not None else SamplingParams(),
                   stream=stream)
    try:
        check_generate(msg)
    except ProtocolError as exc:
        raise RequestFailed(exc.code, exc.message, exc.request_id) from None
    return msg


def encode_generate(msg: Generate, max_message_bytes: int) -> bytes:
    """The frame of msg. One over the service's limit is refused here: the service answers
    one a little over it, but ZeroMQ drops the connection of one far over it without a word,
    and the request would wait forever."""
    frame = encode(msg)
    if len(frame) > max_message_bytes:
        raise RequestFailed(
            "message_too_large",
            f"request {msg.id!r} is {len(frame):,} bytes; the service takes messages up to "
            f"{max_message_bytes:,} bytes: send a shorter prompt (or, if the service "
            f"runs with a larger service.max_message_bytes, give the client that "
            f"max_message_bytes)", msg.id)
    return frame


def check_service_timeout(service_timeout_s: float | None, heartbeat_interval_s: float) -> None:
    if service_timeout_s is not None and not service_timeout_s > heartbeat_interval_s:
        raise ValueError(f"service_timeout_s = {service_timeout_s:g} must be longer than "
                         f"heartbeat_interval_s = {heartbeat_interval_s:g}: the service is only "
                         f"asked for a sign of life once per heartbeat (None: never give up)")
