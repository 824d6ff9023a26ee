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
from pathlib import Path

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


class _PairCodec:
    """msgpack out; in, only the message union the peer may send. A frame that cannot be
    decoded raises msgspec.DecodeError, and nothing else."""

    def __init__(self, receives: type) -> None:
        self.encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(receives).decode

    def decode(self, frame: bytes):
        try:
            return self._decode(frame)
        except (UnicodeDecodeError, RecursionError) as exc:  # msgspec lets these through
            raise msgspec.DecodeError(f"not valid msgpack: {exc}") from None


class SchedulerSideCodec(_PairCodec):
    """Encodes plans and Shutdown; decodes results, WorkerReady and WorkerFailed."""

    def __init__(self) -> None:
        super().__init__(WorkerToScheduler)


class WorkerSideCodec(_PairCodec):
    """Encodes results, WorkerReady and WorkerFailed; decodes plans and Shutdown."""

    def __init__(self) -> None:
        super().__init__(SchedulerToWorker)
