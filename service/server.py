"""The scheduler process: clients in over ZMQ ROUTER, plans out to the worker, tokens back.

Anyio tasks share one event loop (asyncio backend):
- `_receive_loop`: decodes client frames, admits requests into the SchedulerCore, aborts; a
  large text prompt is tokenized on a thread meanwhile (service/prompt_intake.py), its request
  in flight but not yet in the core (`_tokenizing`);
- one step loop per data-parallel replica (service/replica.py; one with parallel.dp = 1):
  plan -> worker.step -> process result -> stream replies (service/replies.py), while there
  is work;
- `_housekeeping_loop`: publishes telemetry snapshots and aborts requests of silent clients.
The OpenAI-compatible HTTP API (service/http/) runs on the same loop and submits through
`submit`, which routes each request to the least-loaded replica (service/replica_set.py).
Each replica's worker is a separate process (see worker_supervisor); if it dies mid-step, its
requests get an Error, it is restarted, and serving continues. A signal drains, then stops.
"""

from __future__ import annotations

import logging
import signal
import uuid

import anyio
import anyio.lowlevel
import zmq
import zmq.asyncio

from ipc.client_messages import Abort, AdminAbort, Error, Generate, Health, Ping, Pong, WorkerState
from ipc.codec import ProtocolError, decode_client_request
from ipc.process_heap import release_free_heap, release_library_pages
from ipc.worker_messages import WorkerInfo
from service.admin import AdminOps
from service.client_registry import ClientRegistry
from service.config import ServiceConfig, overlap_on, worker_config_for
from service.endpoint_security import EndpointSecurity, bind_endpoint
from service.http.app import OpenAIApp
from service.http.http_server import HttpServer
from service.metrics import ServiceMetrics
from service.prompt_intake import LargeText, PromptIntake
from service.counters import ServiceCounters
from service.replica_set import ReplicaSet
from service.replies import Replies
from service.request import FinishReason, RequestOutput
from service.scheduler_core import RequestRejected, SchedulerConfig
from service.telemetry import TelemetryPublisher
from service.tokenizer import TextTokenizer

log = logging.getLogger("fmserve.service")


class Service:
    def __init__(self, cfg: ServiceConfig, model_path: str) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.tokenizer = TextTokenizer.from_model_path(model_path)
        self.intake = PromptIntake(self.tokenizer)
        # Requests whose prompt a thread is tokenizing: rid -> a ticket of that one request (an
        # aborted id may be reused while the thread of the old one still runs).
        self._tokenizing: dict[str, object] = {}
        self._intake_tasks: anyio.abc.TaskGroup | None = None
        self.clients = ClientRegistry()
        self.security = EndpointSecurity(cfg.service)  # reads CURVE keys: refused before loading
        self.counters = ServiceCounters()
        self.instance = uuid.uuid4().hex  # Pong/Stats: clients tell a restarted service by it
        self._ctx = zmq.asyncio.Context()
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # Frames up to the limit get decoded; a bit over it gets Error(message_too_large); only a
        # frame far beyond it (4x, a memory guard) makes ZMQ drop that connection silently.
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.service.max_message_bytes)
        self.router.setsockopt(zmq.SNDHWM, cfg.service.max_queued_replies)  # per client:
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue raises, never drops
        self.metrics = ServiceMetrics(self.counters, lambda: self.replicas.schedulers,
                                      lambda: self.replicas.statuses(),
                                      lambda: self.worker_state, cfg.spec)
        self.replies = Replies(self.router, self.clients, self.counters, self.metrics,
                               self._abort)
        self.replicas = ReplicaSet.build(cfg, worker_config_for(cfg, model_path), self.replies,
                                         self.counters)
        self.admin = AdminOps(cfg.service.admin_token, self._abort, self.replies)
        self.draining = False  # from a signal (or the shutdown) on: new requests refused
        self.http = HttpServer(OpenAIApp(self, cfg.http.api_key, cfg.http.max_body_bytes).app,
                               cfg.http.host, cfg.http.port) if cfg.http.enabled else None
        self.telemetry = TelemetryPublisher(
            self._ctx, cfg.service.telemetry_endpoint, self.counters, cfg.spec,
            overlap_on(cfg, "cpu"), include_text=cfg.service.telemetry_include_text)
        for sock in (self.router, self.telemetry.socket):
            self.security.secure(sock)
        self.bound_endpoint: str | None = None
        release_free_heap()  # what building the tokenizer and its tables left (a GGUF's in Python)
        release_library_pages()  # before the event loop's threads: start-up code leaves the RSS

    @property
    def info(self) -> WorkerInfo | None:
        return self.replicas.info

    @property
    def worker_state(self) -> WorkerState:
        return self.replicas.state

    # -- lifecycle --------------------------------------------------------------------------

    async def run(self, ready: anyio.Event | None = None) -> None:
        info = await self.replicas.start(self.tokenizer, SchedulerConfig(
            max_tokens_per_step=self.cfg.runtime.max_tokens_per_step,
            prefix_cache=self.cfg.scheduling.prefix_cache))
        self.overlap = self.telemetry.overlap = overlap_on(self.cfg, info.device)
        self.security.start(self._ctx)
        bind_endpoint(self.cfg.service, "client_endpoint", self.router.bind)
        self.bound_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        bind_endpoint(self.cfg.service, "telemetry_endpoint", lambda _: self.telemetry.bind())
        n = len(self.replicas)
        log.info("serving %s on %s (telemetry %s)%s", info.model_name, self.bound_endpoint,
                 self.telemetry.endpoint, f", {n} DP attention ranks (overlap off)"
                 if self.cfg.parallel.dp_attention else f", {n} data-parallel replicas"
                 if n > 1 else "")
        if self.http is not None:
            log.info("OpenAI-compatible API on %s/v1", await self.http.start())
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._signal_watch, tg)
                tg.start_soon(self._receive_loop)
                for group in self.replicas.groups:  # a replica, or a DP attention group
                    tg.start_soon(group.step_loop, self.overlap)
                tg.start_soon(self._housekeeping_loop)
                if ready is not None:
                    ready.set()
        finally:
            with anyio.CancelScope(shield=True):
                await self._shutdown()

    async def _signal_watch(self, tg: anyio.abc.TaskGroup) -> None:
        """A first signal drains (service.drain_timeout_s), a second one stops at once."""
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                name, grace = signal.Signals(signum).name, self.cfg.service.drain_timeout_s
                if self.draining or not grace:
                    log.info("received %s: shutting down now", name)
                    tg.cancel_scope.cancel()
                    return
                self.draining = True
                log.info("received %s: draining: new requests are refused; the %d in flight "
                         "have up to %g s to finish (a second signal stops at once)", name,
                         len(self.clients.requests), grace)
                tg.start_soon(self._drain, tg.cancel_scope, grace)

    async def _drain(self, scope: anyio.CancelScope, grace: float) -> None:
        with anyio.move_on_after(grace):
            while self.clients.requests:
                await anyio.sleep(0.05)
        scope.cancel()

    async def _shutdown(self) -> None:
        self.draining = True
        for out in self.replicas.fail_all("the service is shutting down"):
            await self.replies.terminal(out, code="service_shutdown")
        for rid in list(self._tokenizing):  # their tokenizing was cancelled with the loop
            del self._tokenizing[rid]
            await self.replies.terminal(RequestOutput(
                rid, [], "", finish_reason=FinishReason.ERROR,
                error="the service is shutting down"), code="service_shutdown")
        if self.http is not None:  # its open responses have had their terminal messages
            await self.http.stop()
        await self.replicas.stop(timeout_s=5.0)
        self.telemetry.close()
        self.router.close(linger=0)
        self.security.stop()
        self._ctx.term()

    # -- clients ----------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        async with anyio.create_task_group() as self._intake_tasks:  # prompts on threads
            await self._receive_frames()

    async def _receive_frames(self) -> None:
        while True:
            # A ready zmq.asyncio recv completes without suspending: with frames always waiting
            # (a client flooding pings) this loop would never let the step loop run. Yield.
            await anyio.lowlevel.checkpoint()
            frames = await self.router.recv_multipart()
            if frames[0] in self.clients.cut_off:  # over its unread bound: ignored
                continue
            self.clients.touch(frames[0])  # any message is a sign of life
            if len(frames) != 2:
                # Answer rather than drop, or the client (often a REQ socket) waits forever. A
                # REQ socket reads only replies behind an empty delimiter frame: keep it if sent.
                log.warning("refusing a message of %d frames (expected identity + payload)",
                            len(frames))
                envelope = frames[:2] if frames[1:2] == [b""] else frames[:1]
                await self.replies.send_envelope(envelope, Error(
                    None, "invalid_message",
                    f"a message must be exactly one frame holding one msgpack map, got "
                    f"{len(frames) - 1} frames; connect a DEALER socket (not REQ, whose empty "
                    f"delimiter frame is an extra frame) and send the payload frame only"))
                continue
            identity, payload = frames
            try:
                msg = decode_client_request(payload, self.cfg.service.max_message_bytes)
            except ProtocolError as exc:
                await self.replies.send(identity, Error(exc.request_id, exc.code, str(exc)))
                continue
            try:
                await self._dispatch(identity, msg)
            except Exception:  # a bug: answer it, and keep serving everyone else
                log.exception("failed on a %s message from %s", type(msg).__name__,
                              identity.hex())
                self._drop_unowned(identity, msg)
                await self.replies.send(identity, Error(
                    getattr(msg, "id", None), "internal_error",
                    f"the service failed on this {type(msg).__name__} message (a bug; the "
                    f"service log has the details): nothing of it is in flight"))

    async def _dispatch(self, identity: bytes, msg) -> None:
        if isinstance(msg, Generate):
            await self.submit(identity, msg)
        elif isinstance(msg, Abort):
            await self._on_abort(identity, msg)
        elif isinstance(msg, Health):
            await self.replies.send(identity, self.counters.stats(
                self.replicas.accounting(), self.info, self.worker_state, self.instance,
                waiting_extra=len(self._tokenizing), draining=self.draining,
                replicas=self.replicas.statuses()))
        elif isinstance(msg, Ping):
            await self.replies.send(identity, Pong(self.instance))
        elif isinstance(msg, AdminAbort):
            await self.admin.abort(identity, msg)

    def _drop_unowned(self, identity: bytes, msg) -> None:
        """After a failure in a generate: a request the scheduler took but no client owns would
        run with nobody to answer; take it back."""
        if isinstance(msg, Generate):
            rid = self.clients.scheduler_id(identity, msg.id)
            if rid not in self.clients.requests:
                self.replicas.abort(rid)

    async def submit(self, identity: bytes, msg: Generate) -> None:
        """Admit a request from a ZMQ client, or from the HTTP API (service/http/). Every
        outcome, a refusal included, is a reply to `identity`."""
        rid = self.clients.scheduler_id(identity, msg.id)
        if rid in self.clients.requests:
            await self.replies.send(identity, Error(
                msg.id, "duplicate_id",
                f"request id '{msg.id}' is already in flight on this connection: use a new id"))
            return
        refusal = self._refusal()
        if refusal is not None:
            await self.replies.send(identity, Error(msg.id, *refusal))
            return
        try:
            prompt = self.intake.prepare(msg, self.replicas.max_seq_len)
            if isinstance(prompt, list):
                self._route(rid, prompt, msg.params)
        except RequestRejected as exc:
            await self.replies.send(identity, Error(msg.id, exc.code, str(exc)))
            return
        except Exception as exc:  # a template or tokenizer failure: the client's input
            await self.replies.send(identity, Error(msg.id, "invalid_prompt",
                                                    f"could not encode the prompt: {exc}"))
            return
        self.clients.add(identity, msg.id, msg.stream)
        if isinstance(prompt, LargeText):  # in flight from now on; admitted once tokenized
            self._tokenizing[rid] = ticket = object()
            self._intake_tasks.start_soon(self._admit_tokenized, rid, prompt, msg.params, ticket)

    async def _admit_tokenized(self, rid: str, prompt: LargeText, params, ticket: object
                               ) -> None:
        try:
            ids, failure = await self.intake.encode(prompt), None
        except Exception as exc:  # a tokenizer failure: the client's input
            ids, failure = None, exc
        if self._tokenizing.get(rid) is not ticket:
            return  # aborted meanwhile (its client timed out, or asked): already answered
        del self._tokenizing[rid]
        try:
            if failure is not None:
                raise RequestRejected("invalid_prompt", f"could not encode the prompt: {failure}")
            self._route(rid, ids, params)
        except Exception as exc:
            code = exc.code if isinstance(exc, RequestRejected) else "internal_error"
            if code == "internal_error":  # a bug: nothing of the request may stay behind
                log.exception("failed to admit the tokenized request %s", rid)
                self.replicas.abort(rid)
            await self.replies.terminal(RequestOutput(
                rid, [], "", finish_reason=FinishReason.ERROR, error=str(exc)), code=code)

    def _route(self, rid: str, prompt_ids: list[int], params) -> None:
        """Into the least-loaded replica's queue (RequestRejected: nothing is kept)."""
        replica = self.replicas.route()
        if replica is None:
            raise RequestRejected("worker_unavailable", "the model worker is down and could "
                                  "not be restarted; see the service log")
        replica.scheduler.add_request(rid, prompt_ids, params)
        replica.wake()

    def _refusal(self) -> tuple[str, str] | None:
        """Why no request can be taken now, as (code, message); None when one can."""
        if self.draining:
            return "shutting_down", ("the service is shutting down (those in flight may "
                                     "finish; new requests are refused): retry once it is back")
        if self.worker_state == "down":
            return ("worker_unavailable",
                    "the model worker is down and could not be restarted; see the service log")
        limit, acc = self.cfg.scheduling.max_queued_requests, self.replicas.accounting()
        # Queued behind the free slots; those ahead of them only await the next plan.
        if limit and acc["waiting"] + len(self._tokenizing) - acc["free_slots"] >= limit:
            return "queue_full", (f"{limit} requests are already queued "
                                  f"(scheduling.max_queued_requests): retry later")
        return None

    async def cancel(self, identity: bytes, request_id: str) -> None:
        """Abort a request of `identity` if it is still in flight (an HTTP client left)."""
        out = self._abort(self.clients.scheduler_id(identity, request_id))
        if out is not None:
            await self.replies.terminal(out)

    def _abort(self, rid: str) -> RequestOutput | None:
        """End a request in flight, admitted or still being tokenized; None if there is none."""
        if self._tokenizing.pop(rid, None) is not None:
            return RequestOutput(rid, [], "", finish_reason=FinishReason.ABORT)
        return self.replicas.abort(rid) if rid in self.clients.requests else None

    async def _on_abort(self, identity: bytes, msg: Abort) -> None:
        out = self._abort(self.clients.scheduler_id(identity, msg.id))
        if out is None:
            await self.replies.send(identity, Error(
                msg.id, "unknown_request", f"no request '{msg.id}' is in flight on this "
                "connection (finished already, or never sent)"))
            return
        await self.replies.terminal(out)

    # -- housekeeping -----------------------------------------------------------------------

    async def _housekeeping_loop(self) -> None:
        interval = self.cfg.service.telemetry_interval_s
        while True:
            await anyio.sleep(interval)
            self.telemetry.publish(self.replicas.schedulers, self.info, self.worker_state,
                                   self.replicas.statuses(), self.draining)
            for identity in self.clients.silent_clients(self.cfg.service.client_timeout_s):
                rids = self.clients.requests_of(identity)
                log.warning("client %s silent for %.0f s: aborting its %d request(s)",
                            identity.hex(), self.cfg.service.client_timeout_s, len(rids))
                for rid in rids:
                    out = self._abort(rid)
                    if out is not None:
                        await self.replies.terminal(out)
                    else:
                        self.clients.pop(rid)
