"""`AsyncClient`: the asyncio core of the fmserve client.

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
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from ipc.client_errors import (
    ClientClosed,
    RequestFailed,
    RequestTimeout,
    ServiceRestarted,
    ServiceUnavailable,
    no_answer,
)
from ipc.client_messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    Chunk,
    Error,
    Finished,
    Health,
    Ping,
    Pong,
    Stats,
)
from ipc.client_request import (
    DEFAULT_ENDPOINT,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_SERVICE_TIMEOUT_S,
    Completion,
    build_generate,
    check_service_timeout,
    encode_generate,
)
from ipc.codec import ProtocolError, decode_service_reply, encode
from ipc.curve import CurveClient
from ipc.sampling import SamplingParams

log = logging.getLogger(__name__)


class AsyncClient:
    """Asyncio client. Create it anywhere; its socket is made on first use in the running loop.

    `service_timeout_s`: while requests are in flight, how long the service may send nothing
    at all (not even a Pong) before they all fail with `ServiceUnavailable`; None = never.
    `max_message_bytes`: the service's `service.max_message_bytes`; a larger request fails
    with `RequestFailed("message_too_large")` before it is sent. `curve`: the keys of a service
    that runs CURVE (`ipc.curve.curve_client`); without the right ones it never answers.
    """

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, *,
                 heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                 timeout_s: float | None = None,
                 service_timeout_s: float | None = DEFAULT_SERVICE_TIMEOUT_S,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 context: zmq.asyncio.Context | None = None,
                 curve: CurveClient | None = None) -> None:
        check_service_timeout(service_timeout_s, heartbeat_interval_s)
        self.endpoint = endpoint
        self.max_message_bytes = max_message_bytes
        self.heartbeat_interval_s = heartbeat_interval_s
        self.timeout_s = timeout_s  # default per-message wait of generate(); None = forever
        self.service_timeout_s = service_timeout_s
        self._heard_at = 0.0  # loop time of the last frame from the service (or of going busy)
        self._instance = ""  # the service run that answered last (Pong/Stats.instance)
        self._context = context
        self._curve = curve
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
            if self._curve is not None:
                self._curve.apply(sock)
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
        frame = encode_generate(msg, self.max_message_bytes)
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
            try:  # a DEALER with no connection to queue on (CURVE refused it) waits to send
                async with asyncio.timeout(self.service_timeout_s):
                    await sock.send(frame)
            except TimeoutError:
                raise no_answer(self.endpoint, self.service_timeout_s) from None
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
        sock = self._start()
        try:  # may wait to send like generate(): bounded the same way
            async with asyncio.timeout(self.service_timeout_s):
                await sock.send(encode(Abort(id=request_id)))
        except TimeoutError:
            raise no_answer(self.endpoint, self.service_timeout_s) from None

    async def health(self, timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S) -> Stats:
        """The service's state; `ServiceUnavailable` if it does not answer within timeout_s."""
        sock = self._start()
        waiter = asyncio.get_running_loop().create_future()
        self._health_waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await sock.send(encode(Health()))  # may wait too: see generate()
                return await waiter
        except TimeoutError:
            raise no_answer(self.endpoint, timeout_s) from None
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
                try:  # bounded: a DEALER with no connection (CURVE refused) waits to send,
                    # and this loop must go on to notice the silence
                    async with asyncio.timeout(tick):
                        await self._socket.send(encode(Ping()))
                except TimeoutError:
                    continue
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
