"""The exceptions the fmserve client raises, all under `ClientError`."""

from __future__ import annotations


class ClientError(Exception):
    """Base of the errors the client raises."""


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


def no_answer(endpoint: str, waited_s: float) -> ServiceUnavailable:
    """The error for a service that did not answer at all within waited_s."""
    return ServiceUnavailable(
        f"no answer from an fmserve service at {endpoint} within {waited_s:g} s. "
        f"Is it running? Start it with `fmserve serve` (or point the client at the endpoint "
        f"the service binds, see [service] client_endpoint in config.toml). A service that "
        f"runs CURVE (service.curve_keys) answers only clients holding keys it admits "
        f"(--curve-keys)."
    )
