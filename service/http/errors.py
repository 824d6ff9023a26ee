"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
status each of the service's error codes stands for."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

# The service's Error codes (ipc/client_messages.py) as HTTP statuses; anything else is a 500.
STATUS_OF_CODE = {
    "invalid_params": 400, "invalid_prompt": 400, "prompt_too_long": 400, "duplicate_id": 400,
    "invalid_json": 400, "unsupported_parameter": 400,
    "invalid_api_key": 401, "model_not_found": 404, "not_found": 404,
    "method_not_allowed": 405, "message_too_large": 413, "queue_full": 429,
    "worker_unavailable": 503, "worker_died": 503, "service_shutdown": 503,
    "shutting_down": 503,
    "worker_restarting": 503,
}
TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                  404: "invalid_request_error", 405: "invalid_request_error",
                  413: "invalid_request_error",
                  429: "rate_limit_error", 503: "service_unavailable"}


class ErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None
    code: str


class ErrorEnvelope(msgspec.Struct, frozen=True):
    error: ErrorBody


class ApiError(Exception):
    """A request the API refuses or could not complete; `code` as in the ZMQ protocol."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    @property
    def status(self) -> int:
        return STATUS_OF_CODE.get(self.code, 500)

    def body(self) -> ErrorEnvelope:
        return ErrorEnvelope(ErrorBody(self.message, TYPE_OF_STATUS.get(self.status, "server_error"),
                                       self.param, self.code))

    def response(self) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return Response(msgspec.json.encode(self.body()), self.status, headers,
                        media_type="application/json")
