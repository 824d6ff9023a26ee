"""Small ZMQ helpers shared by the scheduler and the worker: sockets, endpoints, codecs.

Scheduler <-> worker uses one PAIR socket per worker process: the scheduler binds a fresh
`ipc://` endpoint, the worker connects. PAIR is exactly one peer, in order, both directions,
which is all a supervised 1:1 link needs (no routing identities to carry). A restarted worker
gets a new endpoint and new sockets, so a dead peer's queued messages can never leak into the
new conversation.
"""

from __future__ import annotations

import os
import tempfile
import typing
from pathlib import Path
from typing import Any

import msgspec
import zmq

from ipc.worker_messages import SchedulerToWorker, WorkerToScheduler

# Unix socket paths must fit in sockaddr_un.sun_path (108 bytes on Linux, 104 on macOS).
_MAX_IPC_PATH = 100


def configure_socket(sock: zmq.Socket, linger_ms: int = 0) -> zmq.Socket:
    """Linger 0 by default: closing a socket must never hang on undelivered messages."""
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


def make_ipc_dir(prefix: str = "fmserve-") -> Path:
    """A private temporary directory short enough to hold an ipc:// socket file."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if len(str(path)) + 16 > _MAX_IPC_PATH:  # a long $TMPDIR: fall back to /tmp
        os.rmdir(path)
        path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    return path


def ipc_endpoint(directory: Path, name: str) -> str:
    return f"ipc://{directory / name}"


def ipc_path(endpoint: str) -> Path | None:
    """The socket file behind an ipc:// endpoint (None for tcp:// and others)."""
    return Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None


def _is_msgpack_array(data: bytes) -> bool:
    first = data[0] if data else 0
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


class UnionDecoder:
    """Decodes a union of tagged Structs, even one that mixes `array_like` Structs (encoded as
    msgpack arrays) with map-encoded ones, which a single msgspec Decoder refuses. The two
    encodings are told apart by the msgpack container type of the message; when the union
    is all of one kind this is exactly one msgspec Decoder."""

    def __init__(self, union: Any) -> None:
        members = typing.get_args(union) or (union,)
        arrays = [t for t in members if t.__struct_config__.array_like]
        maps = [t for t in members if not t.__struct_config__.array_like]
        self._array = msgspec.msgpack.Decoder(typing.Union[tuple(arrays)]) if arrays else None
        self._map = msgspec.msgpack.Decoder(typing.Union[tuple(maps)]) if maps else None

    def decode(self, data: bytes):
        dec = self._array if _is_msgpack_array(data) else self._map
        if dec is None:  # let msgspec produce its usual error for a wrong container type
            dec = self._map or self._array
        return dec.decode(data)


class SchedulerSideCodec:
    """Encodes plans and Shutdown; decodes results, WorkerReady and WorkerFailed."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = UnionDecoder(WorkerToScheduler)

    def encode(self, msg: SchedulerToWorker) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes) -> WorkerToScheduler:
        return self._dec.decode(data)


class WorkerSideCodec:
    """Encodes results, WorkerReady and WorkerFailed; decodes plans and Shutdown."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = UnionDecoder(SchedulerToWorker)

    def encode(self, msg: WorkerToScheduler) -> bytes:
        return self._enc.encode(msg)

    def decode(self, data: bytes) -> SchedulerToWorker:
        return self._dec.decode(data)
