"""Which client (ROUTER identity) owns which request, and when each client was last heard.

Request ids are chosen by clients, so the scheduler's id is `<identity hex>/<client id>`: two
clients may both call their request "1" without colliding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ClientRequestInfo:
    identity: bytes
    client_id: str
    stream: bool
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    # Non-streaming requests collect everything here and send one Chunk at the end.
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class ClientRegistry:
    def __init__(self) -> None:
        self.requests: dict[str, ClientRequestInfo] = {}
        self._by_client: dict[bytes, set[str]] = {}
        self._last_seen: dict[bytes, float] = {}
        # In-process clients (the HTTP API): their replies go to these callables, not the
        # socket, and they are never timed out for silence (their connection is watched).
        self.local_sinks: dict[bytes, Callable[[object], None]] = {}
        self.cut_off: set[bytes] = set()  # over their unread-reply bound: ignored (replies.py)

    @staticmethod
    def scheduler_id(identity: bytes, client_id: str) -> str:
        return f"{identity.hex()}/{client_id}"

    def touch(self, identity: bytes) -> None:
        self._last_seen[identity] = time.monotonic()

    def add(self, identity: bytes, client_id: str, stream: bool) -> str:
        rid = self.scheduler_id(identity, client_id)
        self.requests[rid] = ClientRequestInfo(identity, client_id, stream)
        self._by_client.setdefault(identity, set()).add(rid)
        return rid

    def pop(self, rid: str) -> ClientRequestInfo | None:
        info = self.requests.pop(rid, None)
        if info is not None:
            owned = self._by_client.get(info.identity)
            if owned is not None:
                owned.discard(rid)
                if not owned:
                    del self._by_client[info.identity]
        return info

    def silent_clients(self, timeout_s: float) -> list[bytes]:
        """Clients with requests in flight that have not been heard from for timeout_s."""
        now = time.monotonic()
        # Forget clients with nothing in flight that have gone quiet: every connection has its
        # own identity, so keeping them all would grow without bound.
        for ident in [i for i, seen in self._last_seen.items()
                      if now - seen > timeout_s and i not in self._by_client]:
            del self._last_seen[ident]
        return [ident for ident in self._by_client if ident not in self.local_sinks
                and now - self._last_seen.get(ident, now) > timeout_s]

    def requests_of(self, identity: bytes) -> list[str]:
        return sorted(self._by_client.get(identity, ()))
