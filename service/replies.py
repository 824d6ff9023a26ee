"""What the service sends to clients for their requests: chunks as tokens come (gathered into
one for a request that does not stream), then `Finished` with its usage, or an `Error`.

A step's replies to one client leave as one ZeroMQ message of one frame per reply
(`outputs`): one send and one wake-up of libzmq's I/O thread instead of one per stream. At 32
streams the service's CPU time a step fell by a fifth on the 2-core EPYC, and on a GPU the
service's time per step is what leaves the worker idle (docs/benchmarks.md). Clients read
frame by frame (docs/protocol.md), so nothing changes for them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from ipc.client_messages import Chunk, Error, Finished, Usage
from ipc.codec import encode
from service.client_registry import ClientRegistry
from service.counters import ServiceCounters
from service.metrics import ServiceMetrics
from service.request import FinishReason, RequestOutput

log = logging.getLogger("fmserve.service")


def usage_of(out: RequestOutput, arrival: float, first_token: float | None, now: float) -> Usage:
    """The `Usage` of a terminal output; times are `time.monotonic()` readings."""
    ttft = None if first_token is None else (first_token - arrival) * 1000.0
    return Usage(out.prompt_tokens, out.completion_tokens, ttft, (now - arrival) * 1000.0,
                 spec_verify_steps=out.spec_verify_steps,
                 spec_accepted_drafts=out.spec_accepted_drafts,
                 spec_accept_length=out.spec_accept_length,
                 spec_accepted_per_position=out.spec_accepted_per_position)


class Replies:
    def __init__(self, router: zmq.asyncio.Socket, clients: ClientRegistry,
                 counters: ServiceCounters, metrics: ServiceMetrics,
                 abort: Callable[[str], RequestOutput | None]) -> None:
        self.router = router
        self.clients = clients
        self.counters = counters
        self.metrics = metrics
        self.abort = abort  # Service._abort: ends a request of a client that is cut off
        self._held: dict[bytes, list[bytes]] | None = None  # a step's frames, per client

    async def send(self, identity: bytes, msg) -> None:
        await self.send_envelope([identity], msg)

    async def send_envelope(self, envelope: list[bytes], msg) -> None:
        local = self.clients.local_sinks.get(envelope[0])
        if local is not None:
            local(msg)
            return
        if envelope[0] in self.clients.cut_off:
            return
        if self._held is not None and len(envelope) == 1:  # a DEALER's: sent with its step's
            self._held.setdefault(envelope[0], []).append(encode(msg))
            return
        await self._send_frames(envelope, [encode(msg)])

    async def _send_frames(self, envelope: list[bytes], frames: list[bytes]) -> None:
        try:
            await self.router.send_multipart([*envelope, *frames], flags=zmq.NOBLOCK)
        except zmq.Again:  # service.max_queued_replies unread (ROUTER_MANDATORY says so)
            await self.cut_off(envelope[0])
        except zmq.ZMQError as exc:  # the client is gone: drop
            log.debug("dropping %d repl(ies) to %s: %s", len(frames), envelope[0].hex(), exc)

    async def outputs(self, outs: list[RequestOutput]) -> None:
        """A step's outputs (`output` each), each client's replies sent as one message."""
        self._held = {}
        try:
            for out in outs:
                await self.output(out)
        finally:
            held, self._held = self._held, None
        for identity, frames in held.items():
            if identity not in self.clients.cut_off:
                await self._send_frames([identity], frames)

    async def cut_off(self, identity: bytes) -> None:
        """A client that leaves too many replies unread: its requests end (their terminal
        messages cannot reach it and are dropped) and its frames are ignored from now on, so
        its queue never grows on and nobody else waits for it."""
        self.clients.cut_off.add(identity)
        rids = self.clients.requests_of(identity)
        log.warning("client %s left too many replies unread (service.max_queued_replies): "
                    "cutting it off and aborting its %d request(s)", identity.hex(), len(rids))
        self.counters.clients_cut_off += 1
        for rid in rids:
            out = self.abort(rid)
            if out is not None:
                await self.terminal(out)
            else:
                self.clients.pop(rid)

    async def output(self, out: RequestOutput) -> None:
        """A step's output for one request: its tokens and text, and its end if it ended."""
        info = self.clients.requests.get(out.rid)
        if info is None:
            return
        if out.token_ids:
            self.counters.output_tokens += len(out.token_ids)
            now = time.monotonic()
            if info.first_token is None:
                info.first_token = now
                self.metrics.ttft.observe(now - info.arrival)
            else:  # the tokens of one step (EAGLE emits several) share its interval
                n = len(out.token_ids)
                self.metrics.itl.observe((now - info.last_token) / n, n)
            info.last_token = now
            lps = [lp.logprob for lp in out.logprobs] if out.logprobs else None
            tops = [lp.top for lp in out.logprobs] if out.logprobs else None
            if info.stream:
                await self.send(info.identity, Chunk(info.client_id, out.token_ids, out.text,
                                                     lps, tops))
            else:
                info.tokens += out.token_ids
                info.text.append(out.text)
                info.logprobs += lps or []
                info.top_logprobs += tops or []
        if out.finished:
            await self.terminal(out)

    async def terminal(self, out: RequestOutput, code: str = "internal_error") -> None:
        """The end of a request: `Error(code)` for a failed one, else what a non-streaming
        request gathered and `Finished`. The request is no longer in flight afterwards."""
        info = self.clients.pop(out.rid)
        if info is None:
            return
        self.counters.finished_requests += 1
        reason = out.finish_reason.value if out.finish_reason else "error"
        self.counters.finished_by_reason[reason] = self.counters.finished_by_reason.get(
            reason, 0) + 1
        self.counters.prompt_tokens += out.prompt_tokens
        self.metrics.e2e.observe(time.monotonic() - info.arrival)
        if out.finish_reason == FinishReason.ERROR:
            await self.send(info.identity, Error(info.client_id, code, out.error or "failed"))
            return
        if not info.stream and info.tokens:
            await self.send(info.identity, Chunk(
                info.client_id, info.tokens, "".join(info.text),
                info.logprobs or None, info.top_logprobs or None))
        usage = usage_of(out, info.arrival, info.first_token, time.monotonic())
        await self.send(info.identity, Finished(info.client_id, out.finish_reason.value, usage))
