"""ipc/curve.py: the key directory `fmserve keys` writes, and what the service and clients read
from it (errors that say which file and what to do)."""

from __future__ import annotations

import stat

import pytest
import zmq

from ipc.curve import CurveKeyError, curve_client, server_keys, write_keys


def test_keys_written_for_a_server_and_two_clients_fit_together(tmp_path):
    keys = tmp_path / "keys"
    first = write_keys(keys)
    assert [p.relative_to(keys).as_posix() for p in first] == [
        "server.key", "server.key_secret", "clients/client.key", "client.key_secret"]
    second = write_keys(keys, "laptop")  # the server pair is kept
    assert [p.relative_to(keys).as_posix() for p in second] == [
        "clients/laptop.key", "laptop.key_secret"]
    for path in keys.rglob("*.key_secret"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    public, secret, clients = server_keys(keys)
    assert sorted(p.name for p in clients.iterdir()) == ["client.key", "laptop.key"]
    for name in ("client", "laptop"):
        client = curve_client(keys, name)
        assert client.server_public == public
        assert zmq.curve_public(client.secret) == client.public
        assert (clients / f"{name}.key").read_bytes().count(client.public) == 1
    assert zmq.curve_public(secret) == public
    with pytest.raises(CurveKeyError, match="laptop.key_secret exists already"):
        write_keys(keys, "laptop")


def test_missing_or_wrong_key_files_are_refused_with_what_to_do(tmp_path):
    keys = tmp_path / "keys"
    with pytest.raises(CurveKeyError, match=r"cannot read the CURVE key .*server.key.*fmserve keys"):
        curve_client(keys)
    write_keys(keys)
    with pytest.raises(CurveKeyError, match="nobody.key_secret"):
        curve_client(keys, "nobody")
    (keys / "public-only.key_secret").write_bytes((keys / "server.key").read_bytes())
    with pytest.raises(CurveKeyError, match="holds no secret key"):
        curve_client(keys, "public-only")
    (keys / "clients" / "client.key").unlink()
    with pytest.raises(CurveKeyError, match="holds no client public key .* so no client could "
                                            "connect"):
        server_keys(keys)
