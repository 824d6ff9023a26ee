"""uvicorn serving the API on the event loop the scheduler runs on (no thread, no process).

uvicorn's own `serve()` would install SIGINT/SIGTERM handlers over the service's; this starts
and stops its server pieces instead, on a socket bound here, so a taken port is a clear error
before anything is served and port 0 picks a free one.
"""

from __future__ import annotations

import logging
import socket

import uvicorn

from service.config import ConfigError

log = logging.getLogger("fmserve.service")


class HttpServer:
    def __init__(self, app, host: str, port: int, graceful_s: float = 5.0) -> None:
        self.host, self.port = host, port
        self.config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning",
                                     access_log=False, timeout_graceful_shutdown=graceful_s)
        self.server = uvicorn.Server(self.config)
        self.sock: socket.socket | None = None

    async def start(self) -> str:
        """Bind and start serving; returns the URL. A port that cannot be bound is a
        ConfigError (fmserve serve checks it before the model loads; a race may still lose)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(self.config.backlog)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"http.port = {self.port} (on {self.host}) cannot be bound: "
                              f"{exc.strerror or exc}; give a free port (--http-port), or stop "
                              f"what holds it") from None
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup(sockets=[sock])
        host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting, let open responses end (each request has had its terminal message
        by now), then close."""
        if self.sock is not None:
            await self.server.shutdown(sockets=[self.sock])
            self.sock = None
