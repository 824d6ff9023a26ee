"""One HTTP request's answers as ordinary scheduler requests, from inside the service process.

The HTTP side is a client like any other: it hands the service `Generate` messages under an
identity of its own (`http-<random>`, so `fmserve top` shows its requests as `<hex>/<id>`), and
the service's replies for that identity come to an in-process queue instead of the ZMQ socket
(`ClientRegistry.local_sinks`). Admission, batching and the one terminal message per request
are the service's own. Leaving the block early (the HTTP client went away, or an error) aborts
every answer not yet ended, at once, freeing its slot and pages.
"""

from __future__ import annotations

import math
import os
from typing import AsyncIterator, Protocol

import anyio

from ipc.client_messages import Chunk, Error, Finished, Generate


class RequestSink(Protocol):
    """What of the service the HTTP side uses (service/server.py's Service)."""

    clients: object  # ClientRegistry, whose local_sinks take our queue

    async def submit(self, identity: bytes, msg: Generate) -> None: ...

    async def cancel(self, identity: bytes, request_id: str) -> None: ...


class LocalRequests:
    def __init__(self, service: RequestSink, generates: list[Generate]) -> None:
        self.service = service
        self.generates = generates
        self.identity = b"http-" + os.urandom(6)
        self.pending = {g.id for g in generates}
        self._send, self._receive = anyio.create_memory_object_stream[object](math.inf)
        self._early: list[object] = []  # read by `refusal`, not yet by `replies`

    async def __aenter__(self) -> LocalRequests:
        self.service.clients.local_sinks[self.identity] = self._send.send_nowait
        for g in self.generates:
            await self.service.submit(self.identity, g)
        return self

    async def __aexit__(self, *exc) -> None:
        with anyio.CancelScope(shield=True):  # also when the HTTP task is being cancelled
            for request_id in sorted(self.pending):
                await self.service.cancel(self.identity, request_id)
        del self.service.clients.local_sinks[self.identity]
        self._send.close()
        self._receive.close()

    def refusal(self) -> Error | None:
        """An Error the service answered at admission (a bad parameter, a full queue, a worker
        down): those come back while `submit` runs, before anything is streamed."""
        while True:
            try:
                self._early.append(msg := self._receive.receive_nowait())
            except anyio.WouldBlock:
                return None
            if isinstance(msg, Error):
                return msg

    async def replies(self) -> AsyncIterator[Chunk | Finished | Error]:
        """Every reply in arrival order, until each request has its terminal message."""
        while self.pending:
            msg = self._early.pop(0) if self._early else await self._receive.receive()
            if isinstance(msg, (Finished, Error)):
                self.pending.discard(msg.id)
            if isinstance(msg, (Chunk, Finished, Error)):
                yield msg
