"""Client library for the fmserve service: `AsyncClient` (asyncio) and `Client` (blocking).

    async with AsyncClient() as client:
        async for msg in client.generate("Hello", params=SamplingParams(temperature=0)):
            if isinstance(msg, Chunk):
                print(msg.text, end="", flush=True)

    with Client() as client:
        print(client.complete(messages=[{"role": "user", "content": "Hi"}]).text)

One DEALER socket carries any number of concurrent requests: a background task reads every
reply and routes it by request id to that request's queue. While requests are in flight the
client sends `Ping` every `heartbeat_interval_s`, because the service aborts the requests of a
client it has not heard from for `client_timeout_s` (see docs/protocol.md). The service answers
every Ping from its event loop, also while the worker computes a long step, so a client that
hears nothing at all for `service_timeout_s` while requests are in flight takes the service for
gone and fails them with `ServiceUnavailable` instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

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
from ipc.codec import ProtocolError, check_generate, decode_service_reply, encode
from ipc.sampling import SamplingParams

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_HEALTH_TIMEOUT_S = 5.0
DEFAULT_SERVICE_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)


class ClientError(Exception):
    """Base of the errors this module raises."""


class RequestFailed(ClientError):
    """The request ended with an `Error` (from the service, or caught before sending)."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ServiceUnavailable(ClientError):
    """No answer from the service: it is not running, or not at this endpoint."""


class ServiceRestarted(ServiceUnavailable):
    """The service at the endpoint is a new run: requests in flight were lost with the old."""


class RequestTimeout(ClientError, TimeoutError):
    """A request waited longer than its `timeout_s` for its next message."""


class ClientClosed(ClientError):
    """The client was closed while the request was in flight."""


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


def _unavailable(endpoint: str, waited_s: float) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"no answer from an fmserve service at {endpoint} within {waited_s:g} s. "
        f"Is it running? Start it with `fmserve serve` (or point the client at the endpoint "
        f"the service binds, see [service] client_endpoint in config.toml)."
    )


def _check_service_timeout(service_timeout_s: float | None, heartbeat_interval_s: float) -> None:
    if service_timeout_s is not None and not service_timeout_s > heartbeat_interval_s:
        raise ValueError(f"service_timeout_s = {service_timeout_s:g} must be longer than "
                         f"heartbeat_interval_s = {heartbeat_interval_s:g}: the service is only "
                         f"asked for a sign of life once per heartbeat (None: never give up)")


class AsyncClient:
    """Asyncio client. Create it anywhere; its socket is made on first use in the running loop.

    `service_timeout_s`: while requests are in flight, how long the service may send nothing
    at all (not even a Pong) before they all fail with `ServiceUnavailable`; None = never.
    `max_message_bytes`: the service's `service.max_message_bytes`; a larger request fails
    with `RequestFailed("message_too_large")` before it is sent.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *,
                 heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 timeout_s: float | None = None,
                 service_timeout_s: float | None = DEFAULT_SERVICE_TIMEOUT_S,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 context: zmq.asyncio.Context | None = None) -> None:
        _check_service_timeout(service_timeout_s, heartbeat_interval_s)
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self.heartbeat_interval_s = heartbeat_interval_s
        self.timeout_s = timeout_s  # default per-message wait of generate(); None = forever
        self.service_timeout_s = service_timeout_s
        self._heard_at = 0.0  # loop time of the last frame from the service (or of going busy)
        self._instance = ""  # the service run that answered last (Pong/Stats.instance)
        self._context = context
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> replies (and exceptions)
        self._health_waiters: list[asyncio.Future] = []
        self._inflight = asyncio.Event()  # set while _queues is non-empty
        self._closed = False

    # ----- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncClient:
        self._start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def _start(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise ClientClosed(f"client for {self.endpoint} is closed")
        if self._socket is None:
            ctx = self._context or zmq.asyncio.Context.instance()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)  # close() never blocks on unsent frames
            sock.connect(self.endpoint)
            self._socket = sock
            self._tasks = [asyncio.create_task(self._receive_loop(), name="fmserve-recv"),
                           asyncio.create_task(self._heartbeat_loop(), name="fmserve-ping")]
        return self._socket

    def close(self) -> None:
        """Stop the background tasks, close the socket, fail every request still in flight."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        if self._socket is not None:
            self._socket.close(linger=0)
        self._fail_all(ClientClosed(f"client for {self.endpoint} was closed"))

    async def aclose(self) -> None:
        """`close()`, then wait for the background tasks to finish."""
        self.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ----- requests --------------------------------------------------------------------------

    async def generate(self, prompt: str | None = None, *, messages: list[Any] | None = None,
                       token_ids: list[int] | None = None,
                       params: SamplingParams | None = None, request_id: str | None = None,
                       stream: bool = True, timeout_s: float | None = ...,  # type: ignore
                       ) -> AsyncIterator[Chunk | Finished]:
        """Yield the request's `Chunk`s, then its `Finished`. An `Error` raises `RequestFailed`.

        `timeout_s` bounds the wait for each next message (default: the client's). Leaving
        the loop early (break, exception, cancellation) aborts the request on the service.
        """
        msg = build_generate(prompt, messages=messages, token_ids=token_ids, params=params,
                             request_id=request_id, stream=stream)
        if timeout_s is ...:
            timeout_s = self.timeout_s
        frame = self._checked_frame(msg)
        sock = self._start()
        if msg.id in self._queues:
            raise ValueError(f"request id {msg.id!r} is already in flight on this client")
        queue: asyncio.Queue = asyncio.Queue()
        if not self._queues:  # silence counts from now, not from before an idle spell
            self._heard_at = asyncio.get_running_loop().time()
        self._queues[msg.id] = queue
        self._inflight.set()
        finished = False
        try:
            await sock.send(frame)
            while True:
                try:
                    async with asyncio.timeout(timeout_s):
                        reply = await queue.get()
                except TimeoutError:
                    raise RequestTimeout(
                        f"request {msg.id!r} got no message from {self.endpoint} for "
                        f"{timeout_s:g} s; it was aborted"
                    ) from None
                if isinstance(reply, BaseException):
                    # The socket is gone: nothing to abort; after a restart the new service
                    # may have got it (sent before the client knew): abort it there.
                    finished = not isinstance(reply, ServiceRestarted)
                    raise reply
                if isinstance(reply, Error):
                    finished = True
                    raise RequestFailed(reply.code, reply.message, reply.id)
                if isinstance(reply, Finished):
                    finished = True
                    yield reply
                    return
                yield reply
        finally:
            self._queues.pop(msg.id, None)
            if not self._queues:
                self._inflight.clear()
            if not finished and not self._closed:
                self._send_nowait(Abort(id=msg.id))

    def _checked_frame(self, msg: Generate) -> bytes:
        """The frame of msg. One over the service's limit is refused here: the service answers
        one a little over it, but ZeroMQ drops the connection of one far over it without a word,
        and the request would wait forever."""
        frame = encode(msg)
        if len(frame) > self.max_message_bytes:
            raise RequestFailed(
                "message_too_large",
                f"request {msg.id!r} is {len(frame):,} bytes; the service takes messages up to "
                f"{self.max_message_bytes:,} bytes: send a shorter prompt (or, if the service "
                f"runs with a larger service.max_message_bytes, give the client that "
                f"max_message_bytes)", msg.id)
        return frame

    async def complete(self, prompt: str | None = None, *,
                       messages: list[Any] | None = None,
                       token_ids: list[int] | None = None,
                       params: SamplingParams | None = None, request_id: str | None = None,
                       timeout_s: float | None = ...) -> Completion:  # type: ignore
        """Run a request to the end and collect its text, tokens, finish reason and usage."""
        texts: list[str] = []
        tokens: list[int] = []
        logprobs: list[float] | None = None
        async for reply in self.generate(prompt, messages=messages, token_ids=token_ids,
                                         params=params, request_id=request_id,
                                         timeout_s=timeout_s):
            if isinstance(reply, Chunk):
                texts.append(reply.text)
                tokens.extend(reply.token_ids)
                if reply.logprobs is not None:
                    logprobs = (logprobs or []) + list(reply.logprobs)
            else:
                return Completion(id=reply.id, text="".join(texts), token_ids=tokens,
                                  finish_reason=reply.reason, usage=reply.usage,
                                  logprobs=logprobs)
        raise AssertionError("generate() ended without Finished")  # generate() never does

    async def abort(self, request_id: str) -> None:
        """Ask the service to stop a request; its stream then ends with Finished("abort")."""
        await self._start().send(encode(Abort(id=request_id)))

    async def health(self, timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S) -> Stats:
        """The service's state; `ServiceUnavailable` if it does not answer within timeout_s."""
        sock = self._start()
        waiter = asyncio.get_running_loop().create_future()
        self._health_waiters.append(waiter)
        try:
            await sock.send(encode(Health()))
            async with asyncio.timeout(timeout_s):
                return await waiter
        except TimeoutError:
            raise _unavailable(self.endpoint, timeout_s) from None
        finally:
            if waiter in self._health_waiters:
                self._health_waiters.remove(waiter)

    @property
    def requests_in_flight(self) -> int:
        return len(self._queues)

    # ----- background tasks ------------------------------------------------------------------

    def _send_nowait(self, msg: Any) -> None:
        """Best-effort send from places that cannot await (cleanup of an abandoned stream)."""
        try:
            self._socket.send(encode(msg), flags=zmq.DONTWAIT)
        except (zmq.ZMQError, AttributeError, RuntimeError):
            pass

    async def _receive_loop(self) -> None:
        sock = self._socket
        try:
            while True:
                frame = await sock.recv()
                self._heard_at = asyncio.get_running_loop().time()  # any frame: it lives
                try:
                    reply = decode_service_reply(frame)
                except ProtocolError as exc:
                    # A bug in the service or a version mismatch: fail the request if we know it.
                    log.warning("undecodable reply from %s: %s", self.endpoint, exc.message)
                    if exc.request_id in self._queues:
                        self._queues[exc.request_id].put_nowait(
                            RequestFailed(exc.code, exc.message, exc.request_id))
                    continue
                self._route(reply)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            if not self._closed:
                self._fail_all(ServiceUnavailable(f"socket to {self.endpoint} failed: {exc}"))

    def _route(self, reply: Any) -> None:
        if isinstance(reply, Error) and reply.code == "unknown_request":
            # The answer to an abort that came too late, never a request's end: a request
            # started since with the same id must not take it for its own.
            log.debug("abort of %r: it was no longer in flight", reply.id)
            return
        if isinstance(reply, (Chunk, Finished, Error)) and reply.id is not None:
            queue = self._queues.get(reply.id)
            if queue is not None:
                queue.put_nowait(reply)
            # else: a reply to a request we already gave up on (aborted, timed out): drop it.
        elif isinstance(reply, Stats):
            self._check_instance(reply.instance)
            # Any Stats answers every waiter: they all asked for the current state.
            for waiter in self._health_waiters:
                if not waiter.done():
                    waiter.set_result(reply)
        elif isinstance(reply, Error):  # id None: the service could not read one of our frames
            log.warning("fmserve service at %s refused a frame: [%s] %s",
                        self.endpoint, reply.code, reply.message)
            for waiter in self._health_waiters:
                if not waiter.done():
                    waiter.set_exception(RequestFailed(reply.code, reply.message))
        elif isinstance(reply, Pong):
            self._check_instance(reply.instance)

    def _check_instance(self, instance: str) -> None:
        """A new run of the service answers: every request in flight died with the old one, and
        the new one answers pings, so without this they would wait forever."""
        if not instance:
            return
        if self._instance and instance != self._instance:
            for queue in self._queues.values():
                queue.put_nowait(ServiceRestarted(
                    f"the fmserve service at {self.endpoint} was restarted; the requests in "
                    f"flight there were lost with it: retry them"))
        self._instance = instance

    async def _heartbeat_loop(self) -> None:
        # Sleep while idle; once a request is in flight, ping every interval until none is, and
        # check (a few times per service_timeout_s) that the service still says something.
        loop = asyncio.get_running_loop()
        tick = self.heartbeat_interval_s
        if self.service_timeout_s is not None:
            tick = min(tick, self.service_timeout_s / 4)
        pinged_at = loop.time()
        while True:
            if not self._inflight.is_set():
                await self._inflight.wait()
                pinged_at = loop.time()  # the first ping one interval after going busy
            await asyncio.sleep(tick)
            if not self._queues:
                continue
            now = loop.time()
            if self._service_silent(now):
                continue
            if now - pinged_at >= self.heartbeat_interval_s - 1e-3:
                pinged_at = now
                try:
                    await self._socket.send(encode(Ping()))
                except zmq.ZMQError:
                    return

    def _service_silent(self, now: float) -> bool:
        """Fail everything in flight if the service has said nothing for service_timeout_s."""
        if self.service_timeout_s is None or now - self._heard_at < self.service_timeout_s:
            return False
        if self._socket.get(zmq.EVENTS) & zmq.POLLIN:  # a reply waits unread: it lives
            return False
        silent, self._heard_at = now - self._heard_at, now  # a later request gets a full wait
        self._fail_all(ServiceUnavailable(
            f"the fmserve service at {self.endpoint} has not answered for {silent:.0f} s "
            f"(not even a ping; service_timeout_s = {self.service_timeout_s:g}) and may have "
            f"stopped: check that it is running (its log says why it stopped), start it again "
            f"with `fmserve serve` and retry; if it is only busy, give the client a longer "
            f"service_timeout_s"))
        return True

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
        for waiter in self._health_waiters:
            if not waiter.done():
                waiter.set_exception(exc)


class Client:
    """Blocking client: an `AsyncClient` driven by an event loop on a background thread, so
    heartbeats keep flowing while the caller is busy between chunks."""

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *,
                 heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 timeout_s: float | None = None,
                 service_timeout_s: float | None = DEFAULT_SERVICE_TIMEOUT_S,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        _check_service_timeout(service_timeout_s, heartbeat_interval_s)  # before the thread
        self.endpoint = endpoint
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fmserve-client",
                                        daemon=True)
        self._thread.start()
        self._async = AsyncClient(endpoint, heartbeat_interval_s=heartbeat_interval_s,
                                  timeout_s=timeout_s, service_timeout_s=service_timeout_s,
                                  max_message_bytes=max_message_bytes)
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
