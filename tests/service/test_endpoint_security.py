"""service/endpoint_security.py: a key directory that cannot be used is refused before the model
loads; plain ZMQ beyond loopback, allowed with service.insecure, is logged as a warning."""

from __future__ import annotations

import logging

import pytest

from fmserve.cli import main
from service.config import ConfigError, load_config
from service.endpoint_security import EndpointSecurity


def test_serve_refuses_a_key_directory_it_cannot_use_before_loading_the_model(tmp_path, capsys):
    endpoints = ["--endpoint", f"ipc://{tmp_path}/c", "--telemetry-endpoint", f"ipc://{tmp_path}/t"]
    assert main(["serve", "--curve-keys", str(tmp_path / "nowhere"), *endpoints]) == 2
    err = capsys.readouterr().err
    assert f"service.curve_keys = '{tmp_path / 'nowhere'}': cannot read the CURVE key" in err
    assert f"fmserve keys {tmp_path / 'nowhere'}" in err and "worker" not in err


def test_insecure_binding_beyond_loopback_is_logged_as_a_warning(caplog):
    exposed = load_config(None, {"service.client_endpoint": "tcp://0.0.0.0:5557",
                                 "service.insecure": True}).service
    with caplog.at_level(logging.WARNING, logger="fmserve.service"):
        EndpointSecurity(exposed).start(ctx=None)  # without keys it needs no context
        EndpointSecurity(load_config(None, {}).service).start(ctx=None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "service.client_endpoint = tcp://0.0.0.0:5557 is reachable from other machines " \
           "WITHOUT authentication or encryption (service.insecure = true)" in warnings[0]


def test_a_key_directory_without_client_keys_is_refused(tmp_path):
    from ipc.curve import write_keys

    write_keys(tmp_path / "keys")
    (tmp_path / "keys" / "clients" / "client.key").unlink()
    with pytest.raises(ConfigError, match="service.curve_keys = .*holds no client public key"):
        EndpointSecurity(load_config(None, {"service.curve_keys": str(tmp_path / "keys")}).service)
