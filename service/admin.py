"""Control operations, for the holder of the admin token only.

A client ends its own requests with `Abort` (scoped to its connection: the scheduler's key
starts with the connection's identity). Ending anyone's request, `AdminAbort`, changes the
service for others, so it needs `service.admin_token` (or FMSERVE_ADMIN_TOKEN where the service
starts), compared in constant time; with no token configured it is refused for everyone.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from ipc.client_messages import ADMIN_TOKEN_ENV, AdminAbort, Aborted, Error
from service.replies import Replies
from service.request import RequestOutput


def admin_refusal(configured: str, given: str, operation: str) -> Error | None:
    """The `forbidden` error for a control operation carrying the token `given`, or None."""
    if not configured:
        return Error(None, "forbidden", f"{operation} is disabled: this service has no admin "
                     f"token; to enable control operations, set service.admin_token in its "
                     f"config.toml (or {ADMIN_TOKEN_ENV} where it starts) and give clients the "
                     f"same token (fmserve top --admin-token, or {ADMIN_TOKEN_ENV})")
    if not hmac.compare_digest(given.encode(), configured.encode()):
        return Error(None, "forbidden", f"{operation} refused: the admin token is missing or "
                     f"wrong; give the service's service.admin_token (fmserve top "
                     f"--admin-token, or {ADMIN_TOKEN_ENV}). A client may abort its own "
                     f"requests with `abort` without one")
    return None


class AdminOps:
    def __init__(self, token: str, abort: Callable[[str], RequestOutput | None],
                 replies: Replies) -> None:
        """`abort(key)` ends a request in flight by its service-wide key (None: none)."""
        self._token = token
        self._abort = abort
        self._replies = replies

    async def abort(self, identity: bytes, msg: AdminAbort) -> None:
        refused = admin_refusal(self._token, msg.token, "admin_abort")
        if refused is not None:
            await self._replies.send(identity, refused)
            return
        out = self._abort(msg.key)
        if out is None:
            await self._replies.send(identity, Error(
                None, "unknown_request", f"no request with key '{msg.key}' is in flight"))
            return
        await self._replies.terminal(out)
        await self._replies.send(identity, Aborted(msg.key))
