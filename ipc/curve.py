"""ZMQ CURVE keys: `fmserve keys` writes them, the service and its clients read them.

A key directory, as `fmserve keys DIR` writes it (pyzmq's certificate files):

    DIR/server.key          the service's public key: every client needs it
    DIR/server.key_secret   the service's key pair: the service only (mode 600)
    DIR/clients/NAME.key    public keys of the clients the service lets in
    DIR/NAME.key_secret     the key pair of client NAME: that client only (mode 600)

The service reads DIR (`service.curve_keys`); a client reads `server.key` and its
`NAME.key_secret` from a directory holding them (`--curve-keys DIR`, `curve_client(DIR)`).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import zmq
import zmq.auth

SERVER = "server"
CLIENTS = "clients"
DEFAULT_CLIENT = "client"


class CurveKeyError(ValueError):
    """A key directory or file that cannot be used; the message says which and what to do."""


class CurveClient(msgspec.Struct, frozen=True):
    """What a client socket needs to connect to a CURVE service (z85 keys)."""

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Before connect."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read the CURVE key {path}: {exc}; write keys with "
                            f"`fmserve keys {path.parent}`") from None
    if secret and secret_key is None:
        raise CurveKeyError(f"{path} holds no secret key: give the .key_secret file that "
                            f"`fmserve keys` wrote")
    return public, secret_key


def curve_client(directory: str | Path, name: str = DEFAULT_CLIENT) -> CurveClient:
    """A client's keys: `server.key` and `NAME.key_secret` from `directory`."""
    directory = Path(directory)
    server_public, _ = _load(directory / f"{SERVER}.key", secret=False)
    public, secret = _load(directory / f"{name}.key_secret", secret=True)
    return CurveClient(server_public, public, secret)


def server_keys(directory: str | Path) -> tuple[bytes, bytes, Path]:
    """The service's (public, secret) key and the directory of the client keys it admits."""
    directory = Path(directory)
    public, secret = _load(directory / f"{SERVER}.key_secret", secret=True)
    clients = directory / CLIENTS
    if not any(clients.glob("*.key")):
        raise CurveKeyError(f"{clients} holds no client public key (*.key), so no client could "
                            f"connect: add one with `fmserve keys {directory}`")
    return public, secret, clients


def write_keys(directory: str | Path, client: str = DEFAULT_CLIENT) -> list[Path]:
    """Write the server's key pair (unless there is one) and a new key pair for `client`;
    the paths written, in order."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # it holds secrets
    clients = directory / CLIENTS
    clients.mkdir(exist_ok=True)
    if (directory / f"{client}.key_secret").exists():
        raise CurveKeyError(f"{directory / client}.key_secret exists already: give another "
                            f"client name (--client), or remove it to make a new pair")
    written = []
    if not (directory / f"{SERVER}.key_secret").exists():
        written += [Path(p) for p in zmq.auth.create_certificates(directory, SERVER)]
    public, secret = zmq.auth.create_certificates(clients, client)
    os.replace(secret, directory / f"{client}.key_secret")  # never among the admitted keys
    written += [Path(public), directory / f"{client}.key_secret"]
    for path in written:
        if path.suffix == ".key_secret":
            path.chmod(0o600)
    return written
