"""CURVE on the service's two sockets, when `service.curve_keys` names a key directory.

Both sockets (client ROUTER, telemetry PUB) are then CURVE servers: traffic is encrypted and a
ZAP handler on the service's event loop admits only clients whose public key is in the
directory's `clients/` (read once, at start). Without keys the endpoints are plain ZMQ, which
the config allows only on loopback, ipc:// or inproc://, or with `service.insecure`
(service/config.py); that case is logged here as a warning.
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator

from ipc.curve import CurveKeyError, server_keys
from service.config import ConfigError, ServiceSection, exposed

log = logging.getLogger("fmserve.service")


class EndpointSecurity:
    def __init__(self, section: ServiceSection) -> None:
        """Reads the keys now, so a bad directory is refused before the model loads."""
        self.section = section
        self._keys = None
        if section.curve_keys:
            try:
                self._keys = server_keys(section.curve_keys)
            except CurveKeyError as exc:
                raise ConfigError(f"service.curve_keys = {section.curve_keys!r}: {exc}") from None
        self._auth: AsyncioAuthenticator | None = None

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before it binds); nothing without keys."""
        if self._keys is not None:
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey, _ = self._keys

    def start(self, ctx: zmq.asyncio.Context) -> None:
        """In the running event loop, before binding: the ZAP handler that checks client keys."""
        s = self.section
        if self._keys is not None:
            self._auth = AsyncioAuthenticator(ctx, log=log.getChild("zap"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self._keys[2]))
            log.info("CURVE on: admitting the client keys in %s", self._keys[2])
            return
        for key in ("client_endpoint", "telemetry_endpoint"):
            if exposed(getattr(s, key)):  # the config allowed it: service.insecure
                log.warning("service.%s = %s is reachable from other machines WITHOUT "
                            "authentication or encryption (service.insecure = true): anyone "
                            "who reaches it can use the service and read its telemetry; "
                            "`fmserve keys` and service.curve_keys secure it",
                            key, getattr(s, key))

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()


def bind_endpoint(section: ServiceSection, key: str, bind) -> None:
    """`bind(endpoint)`, or say which setting could not be bound and what to do (fmserve serve
    checks tcp endpoints before the model loads; ipc paths and host names only fail here)."""
    endpoint = getattr(section, key)
    try:
        bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"service.{key} = {endpoint!r} cannot be bound: "
                          f"{zmq.strerror(exc.errno)}; give a free local address "
                          f"(--set service.{key}=...), or stop what holds it") from None
