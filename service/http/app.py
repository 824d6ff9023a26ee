"""The OpenAI-compatible API as a Starlette app, for the service's own event loop.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET /health                 GET /metrics (Prometheus text)

Each answer of a request is an ordinary scheduler request (service/http/local_requests.py).
With an API key set, the /v1 routes need `Authorization: Bearer <key>`; /health and /metrics
stay open (a load balancer and a Prometheus scraper read them; neither shows request text).
"""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ipc.client_messages import Chunk, Error
from service.http.errors import ApiError
from service.http.local_requests import LocalRequests
from service.http.openai_params import decode_body, to_generates
from service.http.openai_responses import SSE_DONE, Answers, sse
from service.http.openai_types import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("fmserve.service")


class EventStream(StreamingResponse):
    """SSE that notices a client leaving while nothing is being sent (a queued request), and
    always runs `on_close` (which aborts what is still running)."""

    def __init__(self, content: AsyncIterator[bytes],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self.stream_response(send))
        finally:
            await self.on_close()


async def until_disconnect(receive: Receive, work: Awaitable[Any]) -> Any:
    """Run `work`; cancel it if the client disconnects first (returns None then). What `work`
    raises comes out as itself: from inside the task group it would leave wrapped in an
    ExceptionGroup, which no handler of ApiError catches (a late Error reply became a 500)."""
    result, error = None, None
    async with anyio.create_task_group() as tg:
        async def run() -> None:
            nonlocal result, error
            try:
                result = await work
            except Exception as exc:  # noqa: BLE001 - raised again below, unwrapped
                error = exc
            tg.cancel_scope.cancel()
        tg.start_soon(run)
        while (await receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


class OpenAIApp:
    def __init__(self, service, api_key: str, max_body_bytes: int) -> None:
        self.service = service  # service/server.py's Service
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        self.app = Starlette(routes=routes, exception_handlers={
            404: self._no_route, 405: self._no_route, ApiError: self._api_error,
            Exception: self._internal})

    # -- plumbing -------------------------------------------------------------------------

    async def _api_error(self, request: Request, exc: ApiError) -> Response:
        return exc.response()

    async def _no_route(self, request: Request, exc: Exception) -> Response:
        code = "method_not_allowed" if getattr(exc, "status_code", 404) == 405 else "not_found"
        return ApiError(code, f"{request.method} {request.url.path} is not an endpoint of this "
                        f"API: use POST /v1/chat/completions, POST /v1/completions, GET "
                        f"/v1/models, GET /health or GET /metrics").response()

    async def _internal(self, request: Request, exc: Exception) -> Response:
        log.exception("the HTTP API failed on %s %s", request.method, request.url.path)
        return ApiError("internal_error", f"the service failed on this request "
                        f"({type(exc).__name__}; a bug: the service log has the details)"
                        ).response()

    def _authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            raise ApiError("invalid_api_key", "missing or wrong API key: send the service's "
                           "key as 'Authorization: Bearer <key>' (http.api_key, --api-key or "
                           "FMSERVE_API_KEY where the service runs)")

    async def _body(self, request: Request, kind: type) -> Any:
        declared = request.headers.get("content-length", "")
        too_large = ApiError("message_too_large", f"the request body is over the "
                             f"{self.max_body_bytes:,}-byte limit (http.max_body_bytes)")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > self.max_body_bytes:
                raise too_large
        return decode_body(bytes(body), kind)

    # -- endpoints ------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, ChatCompletionRequest, "chatcmpl-")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, CompletionRequest, "cmpl-")

    async def _complete(self, request: Request, kind: type, prefix: str) -> Response:
        self._authorize(request)
        req = await self._body(request, kind)
        svc = self.service
        if req.model != svc.info.model_name:
            raise ApiError("model_not_found", f"model {req.model!r} is not served here; this "
                           f"service serves {svc.info.model_name!r} (GET /v1/models)", "model")
        base_id = prefix + uuid.uuid4().hex[:24]
        # No max_tokens: up to the context, as OpenAI (the scheduler ends it at the limit).
        generates = to_generates(req, base_id, svc.replicas.max_seq_len,
                                 svc.info.vocab_size)
        answers = Answers(kind is ChatCompletionRequest, base_id, req.model, req.n,
                          lambda token_id: svc.tokenizer.decode([token_id]))
        reqs = LocalRequests(svc, generates)
        await reqs.__aenter__()
        refusal = reqs.refusal()
        if refusal is not None:
            await reqs.__aexit__()
            raise ApiError(refusal.code, refusal.message)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return EventStream(self._events(reqs, answers, usage), reqs.__aexit__)
        try:
            await until_disconnect(request.receive, self._gather(reqs, answers))
        finally:
            await reqs.__aexit__()
        return JSONResponse(answers.response()) if not reqs.pending else Response(status_code=499)

    async def _gather(self, reqs: LocalRequests, answers: Answers) -> None:
        async for msg in reqs.replies():
            if isinstance(msg, Error):
                raise ApiError(msg.code, msg.message)
            answers.add(msg)

    async def _events(self, reqs: LocalRequests, answers: Answers,
                      include_usage: bool) -> AsyncIterator[bytes]:
        async for msg in reqs.replies():
            if isinstance(msg, Error):  # mid-stream: the status has gone out already
                yield sse(ApiError(msg.code, msg.message).body())
                break
            if not isinstance(msg, Chunk) or msg.text or msg.logprobs is not None or \
                    not answers.chat:
                yield answers.chunk_event(msg, include_usage)
            else:
                answers.add(msg)  # a chat chunk with no text (a stop token): nothing to send
        else:
            if include_usage:
                yield answers.usage_event()
        yield SSE_DONE

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "fmserve"}
            for name in [self.service.info.model_name]]})

    async def health(self, request: Request) -> Response:
        svc = self.service
        state = ("draining" if svc.draining else "ok" if svc.worker_state == "ready" else
                 f"worker_{svc.worker_state}")
        return JSONResponse({"status": state, "model": svc.info.model_name},
                            200 if state == "ok" else 503)

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.service.metrics.exposition()
        return Response(body, media_type=content_type)
