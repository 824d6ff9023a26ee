"""`fmserve serve`: load config.toml, apply CLI overrides, run the service until a signal."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

import anyio
import msgspec

from fmserve.arg_types import batch_limit
from fmserve.default_model import resolve_draft_model, resolve_model_path
from ipc.client_messages import ADMIN_TOKEN_ENV
from service.config import ConfigError, ServiceConfig, load_config, parse_set_flags

# Flag -> (dotted config key, more add_argument keywords); a flag left unset (None) does not
# override the file.
OVERRIDE_FLAGS = {
    "--model": ("model.path", {}),
    "--device": ("model.device", {}),
    "--dtype": ("model.dtype", {}),
    "--attention-backend": ("runtime.attention_backend", {}),
    "--page-size": ("runtime.page_size", dict(type=int)),
    "--max-kv-tokens": ("runtime.max_kv_tokens", dict(type=int)),
    "--max-running-requests": ("runtime.max_running_requests", dict(type=int)),
    "--max-tokens-per-step": ("runtime.max_tokens_per_step", dict(type=int)),
    "--endpoint": ("service.client_endpoint",
                   dict(help="client ROUTER endpoint (tcp:// or ipc://)")),
    "--telemetry-endpoint": ("service.telemetry_endpoint", {}),
    "--http-host": ("http.host", dict(help="OpenAI-API address (non-loopback needs a key)")),
    "--http-port": ("http.port", dict(type=int, help="OpenAI-API port (0: any free one)")),
    "--api-key": ("http.api_key", dict(help="key the OpenAI API requires (default: "
                                       "$FMSERVE_API_KEY, else http.api_key)")),
    "--curve-keys": ("service.curve_keys", dict(
        metavar="DIR", help="CURVE on both endpoints, keys from `fmserve keys DIR`")),
    "--insecure": ("service.insecure", dict(action="store_true", help=(
        "allow plain ZMQ on endpoints beyond loopback (logs a warning)"))),
    "--overlap": ("scheduling.overlap", dict(action=argparse.BooleanOptionalAction)),
    "--spec-algorithm": ("spec.algorithm", dict(help="none, eagle3 or eagle")),
    "--draft-model": ("spec.draft_model", dict(help="EAGLE head directory")),
    "--spec-num-steps": ("spec.num_steps", dict(type=int)),
    "--spec-topk": ("spec.topk", dict(type=int)),
    "--spec-num-draft-tokens": ("spec.num_draft_tokens", dict(type=int)),
    "--tp": ("parallel.tp", dict(type=int, help="tensor-parallel worker ranks (default 1)")),
    "--dp": ("parallel.dp", dict(type=int, help="data-parallel worker replicas, each with "
                                            "its own KV cache and batch (default 1)")),
    "--spec-disable-above-batch-size": ("spec.disable_above_batch_size", dict(
        type=batch_limit, help="decode batches larger than this run without drafting (0: "
                               "never; auto: where measured faster)")),
}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="TOML config (default: ./config.toml if it exists, else built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set runtime.page_size=32")
    for flag, (_, kwargs) in OVERRIDE_FLAGS.items():
        p.add_argument(flag, default=None, **kwargs)
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    path = Path(args.config) if args.config else (Path("config.toml") if Path(
        "config.toml").exists() else None)
    overrides = {key: getattr(args, flag[2:].replace("-", "_"))
                 for flag, (key, _) in OVERRIDE_FLAGS.items()}
    if overrides["http.api_key"] is None:
        overrides["http.api_key"] = os.environ.get("FMSERVE_API_KEY") or None
    # The environment beats config.toml (a secret kept out of files), --set beats both.
    overrides["service.admin_token"] = os.environ.get(ADMIN_TOKEN_ENV) or None
    overrides.update(parse_set_flags(args.set))
    return load_config(path, overrides)


def with_draft_model(cfg: ServiceConfig) -> ServiceConfig:
    """An empty spec.draft_model means the head shipped for the default model; a given one is
    checked to be a head directory before the model loads."""
    sp = cfg.spec
    if sp.algorithm == "none":
        return cfg
    head = resolve_draft_model(sp.algorithm, sp.draft_model, cfg.model.path)
    return msgspec.structs.replace(cfg, spec=msgspec.structs.replace(sp, draft_model=str(head)))


def check_endpoints(cfg: ServiceConfig) -> None:
    """Refuse a tcp endpoint (or the HTTP port) that cannot be bound (taken, or not an address
    of this machine) before the model loads: the service binds only after that. A plain
    socket, bound but never listening, so no client can connect to it meanwhile. Hosts that do
    not resolve (ZMQ also takes interface names) and ipc:// paths are left to the bind itself."""
    binds = []
    for key in ("client_endpoint", "telemetry_endpoint"):
        endpoint = getattr(cfg.service, key)
        if endpoint.startswith("tcp://"):
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            binds.append((f"service.{key}", repr(endpoint), host, int(port), socket.AF_INET))
    if cfg.http.enabled and cfg.http.port:
        binds.append(("http.port", f"{cfg.http.port} (on {cfg.http.host})", cfg.http.host,
                      cfg.http.port, socket.AF_UNSPEC))
    for key, shown, host, port, family in binds:
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                "0.0.0.0" if host == "*" else host, port, family, socket.SOCK_STREAM)[0]
        except socket.gaierror:
            continue
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
            try:
                probe.bind(address)
            except OSError as exc:
                raise ConfigError(f"{key} = {shown} cannot be bound: {exc.strerror or exc}; "
                                  f"give a free local address (--set {key}=...), or stop "
                                  f"what holds it") from None


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    cfg = with_draft_model(cfg)
    model_path = str(resolve_model_path(cfg.model.path))
    check_endpoints(cfg)
    from service.server import Service  # after validation: fail fast on a bad config
    anyio.run(Service(cfg, model_path).run, backend="asyncio")
    return 0
