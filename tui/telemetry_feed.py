"""Reads the service's telemetry (ZMQ SUB) in a thread and keeps only the newest snapshot.

The service publishes one whole-state `TelemetrySnapshot` per frame a few times a second.
A monitor that falls behind must never work through a backlog: the SUB socket is set to
`CONFLATE` (ZMQ keeps one message per peer) and the reader drains whatever is queued before
decoding, so a burst of frames costs one decode and the screen always shows the present.

ZMQ reconnects by itself; on top of that the reader reopens its socket while no snapshot has
arrived for `reconnect_every_s`, so a service that comes back (even after a long outage) is
picked up without restarting the monitor.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from ipc.curve import CurveClient
from ipc.telemetry import TelemetrySnapshot

DEFAULT_TELEMETRY_ENDPOINT = "tcp://127.0.0.1:5558"


@dataclass(frozen=True)
class FeedStatus:
    """What the reader knows about the connection, for the header line."""

    endpoint: str
    connected: bool  # a snapshot arrived within stale_after_s
    silent_s: float | None  # seconds since the last snapshot (None: none yet)
    frames: int  # frames received (after conflation)
    decode_errors: int
    last_error: str | None
    unreadable: bool = False  # frames arrive (within stale_after_s) but none decodes

    def describe(self) -> str:
        """One line for the header."""
        if self.connected:
            return f"connected to {self.endpoint}"
        if self.unreadable:  # the service may be up: saying "down?" would send people astray
            return f"cannot read the telemetry from {self.endpoint}: {self.last_error}"
        waited = "no snapshot yet" if self.silent_s is None else \
            f"no snapshot for {self.silent_s:.0f} s"
        return f"service down? {waited} from {self.endpoint}; reconnecting by itself"

    def explain(self) -> str:
        """The longer story, for the event log."""
        if self.connected:
            return self.describe()
        why = f" Last error: {self.last_error}." if self.last_error else ""
        return (f"{self.describe()}. Is `fmserve serve` running with --telemetry-endpoint "
                f"{self.endpoint}?{why}")


class TelemetryFeed:
    """`run()` in a thread; `take()` from the UI for the newest snapshot not yet taken."""

    def __init__(self, endpoint: str = DEFAULT_TELEMETRY_ENDPOINT, *,
                 stale_after_s: float = 2.0, reconnect_every_s: float = 3.0,
                 curve: CurveClient | None = None) -> None:
        """`curve`: the keys of a service that runs CURVE (None: plain ZMQ)."""
        self.endpoint = endpoint
        self.curve = curve
        self.stale_after_s = stale_after_s
        self.reconnect_every_s = reconnect_every_s
        self._decoder = msgspec.msgpack.Decoder(TelemetrySnapshot)
        self._lock = threading.Lock()
        self._latest: TelemetrySnapshot | None = None
        self._latest_seq = 0  # bumped per decoded snapshot
        self._taken_seq = 0
        self._last_at: float | None = None  # monotonic time of the last snapshot
        self._frames = 0
        self._decode_errors = 0
        self._last_error: str | None = None
        self._last_error_at: float | None = None  # monotonic time of the last undecodable frame
        self._stop = threading.Event()

    # ----- UI side ---------------------------------------------------------------------------

    def take(self) -> TelemetrySnapshot | None:
        """The newest snapshot if it was not taken before, else None."""
        with self._lock:
            if self._latest_seq == self._taken_seq:
                return None
            self._taken_seq = self._latest_seq
            return self._latest

    def status(self) -> FeedStatus:
        with self._lock:
            now = time.monotonic()
            silent = None if self._last_at is None else now - self._last_at
            unreadable = self._last_error_at is not None and \
                now - self._last_error_at < self.stale_after_s
            return FeedStatus(self.endpoint, silent is not None and silent < self.stale_after_s,
                              silent, self._frames, self._decode_errors, self._last_error,
                              unreadable)

    def stop(self) -> None:
        self._stop.set()

    # ----- reader thread ---------------------------------------------------------------------

    def _open(self, ctx: zmq.Context) -> zmq.Socket:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CONFLATE, 1)  # must precede connect; frames are single-part
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.endpoint)
        return sock

    def run(self) -> None:
        """Receive until `stop()`; never raises for a bad frame or a missing service."""
        ctx = zmq.Context()
        sock = self._open(ctx)
        opened_at = time.monotonic()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    now = time.monotonic()
                    last = self._last_at if self._last_at is not None else opened_at
                    if now - max(last, opened_at) > self.reconnect_every_s:
                        sock.close(linger=0)
                        sock = self._open(ctx)
                        opened_at = now
                    continue
                frame = None
                while True:  # drain to the newest: older frames are already out of date
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                if frame is not None:
                    self._accept(frame)
        finally:
            sock.close(linger=0)
            ctx.term()

    def _accept(self, frame: bytes) -> None:
        try:
            snap = self._decoder.decode(frame)
        except msgspec.DecodeError as exc:  # ValidationError included: a different version?
            with self._lock:
                self._frames += 1
                self._decode_errors += 1
                self._last_error = (f"{exc} (is it an fmserve service of the same version as "
                                    f"this monitor?)")
                self._last_error_at = time.monotonic()
            return
        with self._lock:
            self._frames += 1
            self._latest = snap
            self._latest_seq += 1
            self._last_at = time.monotonic()
            self._last_error = self._last_error_at = None
