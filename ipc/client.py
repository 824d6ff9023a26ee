"""`Client`: the blocking fmserve client, an `AsyncClient` on a background thread.

    async with AsyncClient() as client:
        async for msg in client.generate("Hello", params=SamplingParams(temperature=0)):
            if isinstance(msg, Chunk):
                print(msg.text, end="", flush=True)

    with Client() as client:
        print(client.complete(messages=[{"role": "user", "content": "Hi"}]).text)

The client is four modules: this one, `ipc.async_client` (the asyncio core: one socket,
routing, heartbeats), `ipc.client_request` (building and checking a request, the defaults)
and `ipc.client_errors` (what it raises).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

from ipc.async_client import AsyncClient
from ipc.client_errors import ClientClosed
from ipc.client_messages import MAX_MESSAGE_BYTES, Chunk, Finished, Stats
from ipc.client_request import (
    DEFAULT_ENDPOINT,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_SERVICE_TIMEOUT_S,
    Completion,
    check_service_timeout,
)
from ipc.curve import CurveClient
from ipc.sampling import SamplingParams


class Client:
    """Blocking client: an `AsyncClient` driven by an event loop on a background thread, so
    heartbeats keep flowing while the caller is busy between chunks."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *,
                 heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 timeout_s: float | None = None,
                 service_timeout_s: float | None = DEFAULT_SERVICE_TIMEOUT_S,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 curve: CurveClient | None = None) -> None:
        check_service_timeout(service_timeout_s, heartbeat_interval_s)  # before the thread
        self.endpoint = endpoint
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fmserve-client",
                                        daemon=True)
        self._thread.start()
        self._async = AsyncClient(endpoint, heartbeat_interval_s=heartbeat_interval_s,
                                  timeout_s=timeout_s, service_timeout_s=service_timeout_s,
                                  max_message_bytes=max_message_bytes, curve=curve)
        self._closed = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _run(self, coro):
        """Run a coroutine on the client's loop and wait for it; Ctrl-C cancels it."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def generate(self, prompt: str | None = None, *, messages: list[Any] | None = None,
                 token_ids: list[int] | None = None, params: SamplingParams | None = None,
                 request_id: str | None = None, stream: bool = True,
                 timeout_s: float | None = ...) -> Iterator[Chunk | Finished]:  # type: ignore
        """Like `AsyncClient.generate`, as a plain iterator. Closing it early aborts."""
        self._check_open()
        agen = self._async.generate(prompt, messages=messages, token_ids=token_ids,
                                    params=params, request_id=request_id, stream=stream,
                                    timeout_s=timeout_s)

        async def next_reply():
            return await agen.__anext__()

        try:
            while True:
                try:
                    yield self._run(next_reply())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                try:  # runs the stream's cleanup (an Abort if it had not finished)
                    asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop).result()
                except RuntimeError:
                    pass  # still running: a cancelled next_reply() ends it and cleans up

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"client for {self.endpoint} is closed")

    def complete(self, prompt: str | None = None, *, messages: list[Any] | None = None,
                 token_ids: list[int] | None = None, params: SamplingParams | None = None,
                 request_id: str | None = None,
                 timeout_s: float | None = ...) -> Completion:  # type: ignore
        self._check_open()
        return self._run(self._async.complete(prompt, messages=messages, token_ids=token_ids,
                                              params=params, request_id=request_id,
                                              timeout_s=timeout_s))

    def abort(self, request_id: str) -> None:
        self._check_open()
        self._run(self._async.abort(request_id))

    def health(self, timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S) -> Stats:
        self._check_open()
        return self._run(self._async.health(timeout_s))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        asyncio.run_coroutine_threadsafe(self._async.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
