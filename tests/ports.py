"""Free TCP ports for the tests that start services or torch.distributed ranks."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, never one this process handed out before: the kernel may
    give a just-closed port twice in a row, and two endpoints of one service must differ."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
