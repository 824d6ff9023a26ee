"""The service's configuration: config.toml, then command-line overrides, checked strictly.

    cfg = load_config(Path("config.toml"), {"runtime.page_size": args.page_size})

`ServiceConfig` is config.toml: one msgspec Struct per section, each key with its default and
its type, range or choices (msgspec `Meta`, `Literal`). [model], [runtime], [spec] and
[parallel] are the worker's own structs (ipc/worker_config.py, ipc/spec_settings.py), declared
once there.
Unknown sections and keys are refused rather than ignored (a typo would otherwise silently
leave a default in place), and every error names the file, the dotted key and what is allowed:

    config.toml: runtime.page_size = 0 is out of range: must be an integer in [1, 1024]
"""

from __future__ import annotations

import difflib
import os
import ipaddress
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from ipc.client_messages import MAX_MESSAGE_BYTES
from ipc.spec_settings import SpecSettings
from ipc.worker_config import (LaunchAhead, ModelSettings, ParallelSettings, RuntimeSettings,
                               WorkerConfig)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says where and why."""


Endpoint = Annotated[str, Meta(
    pattern=r"^(tcp://[^\s:]+:\d+|ipc://\S+|inproc://\S+)\Z",
    description='must be a ZMQ endpoint such as "tcp://127.0.0.1:5557" or "ipc:///tmp/fm"')]


class ServiceSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    client_endpoint: Endpoint = "tcp://127.0.0.1:5557"
    telemetry_endpoint: Endpoint = "tcp://127.0.0.1:5558"
    # Durations: gt=0 refuses 0 and NaN, le refuses inf.
    telemetry_interval_s: Annotated[float, Meta(gt=0, le=60)] = 0.25
    client_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    heartbeat_interval_s: Annotated[float, Meta(gt=0, le=600)] = 2.0
    max_message_bytes: Annotated[int, Meta(ge=1 << 10, le=1 << 30)] = MAX_MESSAGE_BYTES
    drain_timeout_s: Annotated[float, Meta(ge=0, le=3600)] = 30.0
    max_queued_replies: Annotated[int, Meta(ge=16, le=1 << 24)] = 100_000

    # Trust (config.toml says more): admin operations need this token; "" = none allowed.
    admin_token: str = ""
    curve_keys: str = ""  # a directory from `fmserve keys`: CURVE on both endpoints
    insecure: bool = False  # plain ZMQ beyond loopback, on purpose
    telemetry_include_text: bool = False  # publish requests' output text (text_tail)


class HttpSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = True
    host: Annotated[str, Meta(min_length=1)] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    api_key: str = ""  # FMSERVE_API_KEY or --api-key override it
    max_body_bytes: Annotated[int, Meta(ge=1 << 10, le=1 << 30)] = MAX_MESSAGE_BYTES


class SchedulingSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    overlap: Annotated[bool | Literal["auto"], Meta(
        description='must be true, false or "auto"')] = "auto"  # resolved by overlap_on()
    launch_ahead: LaunchAhead = "auto"  # "prepare" on a GPU, "off" on a CPU: config.toml
    prefix_cache: bool = False  # reuse KV pages of shared prompt prefixes
    max_queued_requests: Annotated[int, Meta(ge=0, le=1 << 20)] = 1024


class WorkerSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ready_timeout_s: Annotated[float, Meta(gt=0, le=86400)] = 300.0
    step_timeout_s: Annotated[float, Meta(gt=0, le=86400)] = 120.0
    restart_on_failure: bool = True
    max_restarts: Annotated[int, Meta(ge=0, le=1000)] = 3
    standby: bool = False


class ServiceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    service: ServiceSection = ServiceSection()
    http: HttpSection = HttpSection()
    model: ModelSettings = ModelSettings()
    runtime: RuntimeSettings = RuntimeSettings()
    scheduling: SchedulingSection = SchedulingSection()
    spec: SpecSettings = SpecSettings()
    parallel: ParallelSettings = ParallelSettings()
    worker: WorkerSection = WorkerSection()

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(model=self.model, runtime=self.runtime, spec=self.spec,
                            parallel=self.parallel, launch_ahead=self.scheduling.launch_ahead)


def overlap_on(cfg: ServiceConfig, device: str) -> bool:
    """scheduling.overlap for a worker on `device` ("cpu", "cuda:0", ...). "auto" is on for a
    GPU, where the worker's launches are asynchronous, and on a CPU only where the scheduler
    has a core of its own (3+ cores): on 2 cores its planning during a step stalls the worker's
    OpenMP threads, and overlap on measured 7-11% slower than off (docs/benchmarks.md)."""
    if cfg.parallel.dp_attention:  # its group steps one at a time (service/attention_group.py)
        return False
    if cfg.scheduling.overlap != "auto":
        return cfg.scheduling.overlap
    return device != "cpu" or len(os.sched_getaffinity(0)) >= 3


def worker_cpu_threads(cfg: ServiceConfig) -> int:
    """Torch threads for a CPU worker. With overlap this process works while the worker runs,
    and a worker using every core has an OpenMP thread descheduled at some barriers; on 3-8
    cores one core is left to the scheduler. On 2 cores halving the worker costs far more than
    the stalls (measured at 32 streams, bf16: 226 tok/s with 1 thread, 338 with 2), so it
    keeps both."""
    if cfg.runtime.worker_cpu_threads:
        return cfg.runtime.worker_cpu_threads
    cores = len(os.sched_getaffinity(0))
    # ranks on this machine: tensor-parallel ranks elsewhere (remote_ranks) bring their own cores
    ranks = (1 if cfg.parallel.remote_ranks else cfg.parallel.tp) * cfg.parallel.dp
    if ranks > 1:  # tensor-parallel ranks and replicas share the cores: one team each
        return max(1, cores // ranks)
    return cores - 1 if overlap_on(cfg, "cpu") and 3 <= cores <= 8 else 0


def worker_config_for(cfg: ServiceConfig, model_path: str) -> WorkerConfig:
    """The worker's settings from the service's: config.toml's [model], [runtime] and [spec]
    sections are the WorkerConfig's own structs."""
    return msgspec.structs.replace(
        cfg.worker_config(), model=msgspec.structs.replace(cfg.model, path=model_path),
        runtime=msgspec.structs.replace(cfg.runtime, worker_cpu_threads=worker_cpu_threads(cfg)),
        progress=False)


SECTIONS: dict[str, type[msgspec.Struct]] = {
    f.name: f.type for f in msgspec.structs.fields(ServiceConfig)}


def all_keys() -> list[str]:
    """Every dotted key, in file order ("service.client_endpoint", ...)."""
    return [f"{s}.{k}" for s, cls in SECTIONS.items() for k in cls.__struct_fields__]


# ----- loading -------------------------------------------------------------------------------

def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None,
                ) -> ServiceConfig:
    """Defaults, then the TOML file at `path` (if given), then `overrides`.

    `overrides` maps dotted keys to values, e.g. {"runtime.page_size": 32} from CLI flags;
    a value of None means "flag not given" and is skipped.
    """
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    origins: dict[str, str] = {}  # dotted key -> where its value came from, for errors
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if path is not None:
        source = str(path)
        for section, table in _read_toml(path).items():
            _known_section(source, section)
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: {section} must be a table ([{section}]), "
                                  f"not a single value")
            for key, value in table.items():
                _known_key(source, section, key)
                values[section][key] = value
                origins[f"{section}.{key}"] = source
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r}: keys are written section.key, "
                              f"e.g. runtime.page_size")
        _known_section("command line", section)
        _known_key("command line", section, key)
        values[section][key] = value
        origins[dotted] = "command line"

    try:
        config = msgspec.convert(values, ServiceConfig)
    except msgspec.ValidationError as exc:
        raise _refusal(exc, values, origins) from None
    sources = ([str(path)] if path is not None else []) + (["command line"] if overrides else [])
    _check_consistency(config, " + ".join(sources) or "defaults", origins)
    return config


def parse_set_flags(flags: list[str]) -> dict[str, Any]:
    """`--set runtime.page_size=32` style flags -> overrides. A value is read as a TOML value
    (32, 0.5, true, "x"); anything that is not one is taken as a plain string (cuda:0)."""
    overrides: dict[str, Any] = {}
    for flag in flags:
        dotted, sep, text = flag.partition("=")
        if not sep or not dotted.strip():
            raise ConfigError(f"--set {flag!r}: write it as section.key=value, "
                              f"e.g. runtime.page_size=32")
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        overrides[dotted.strip()] = value
    return overrides


def check_endpoint(value: str) -> str:
    """An endpoint given outside a config (a client's --endpoint), by the same rule."""
    try:
        msgspec.convert(value, Endpoint)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{_show(value)} {_problem(str(exc))}: {_allowed(Endpoint)}") from None
    problem = _port_problem(value)
    if problem:
        raise ConfigError(f"{_show(value)} {problem}")
    return value


def _read_toml(path: Path) -> dict[str, Any]:
    source = str(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib lets this through raw
        raise ConfigError(f"{source}: not valid TOML: not UTF-8 text ({exc.reason} at "
                          f"byte {exc.start})") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ConfigError(f"{source}: cannot read the config file: "
                          f"{exc.strerror or exc}") from None


def _known_section(source: str, section: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section [{section}]{_did_you_mean(section, SECTIONS)}"
                          f"; the sections are: {', '.join(f'[{s}]' for s in SECTIONS)}")


def _known_key(source: str, section: str, key: str) -> None:
    keys = SECTIONS[section].__struct_fields__
    if key not in keys:
        hint = _did_you_mean(key, keys, prefix=f"{section}.")
        raise ConfigError(f"{source}: unknown key {section}.{key}{hint}; "
                          f"[{section}] has: {', '.join(keys)}")


# ----- errors for people ---------------------------------------------------------------------

def _refusal(exc: msgspec.ValidationError, values: dict[str, dict[str, Any]],
             origins: dict[str, str]) -> ConfigError:
    """msgspec's "Expected `int` >= 1 - at `$.runtime.page_size`" as the file, the key, the
    value, what is wrong and what is allowed."""
    text, _, where = str(exc).partition(" - at `$.")
    section, _, key = where.rstrip("`").partition(".")
    key = key.split(".")[0].split("[")[0]  # a nested value: the key it is under
    if section not in SECTIONS or key not in SECTIONS[section].__struct_fields__:
        return ConfigError(f"{' + '.join(sorted(set(origins.values())))}: {where}: {text}")
    field = next(f for f in msgspec.structs.fields(SECTIONS[section]) if f.name == key)
    return ConfigError(f"{origins[f'{section}.{key}']}: {section}.{key} = "
                       f"{_show(values[section][key])} {_problem(text)}: {_allowed(field.type)}")


def _problem(text: str) -> str:
    if ", got `" in text:
        return "has the wrong type"
    if text.startswith("Invalid enum value"):
        return "is not a valid choice"
    if text.startswith("Expected `") and any(op in text for op in ("<", ">")):
        return "is out of range"
    return "is not valid"


def _allowed(annotation: Any) -> str:
    info = mi.type_info(annotation)
    if isinstance(info, mi.Metadata) and "description" in (info.extra_json_schema or {}):
        return info.extra_json_schema["description"]
    info = getattr(info, "type", info)
    if isinstance(info, mi.BoolType):
        return "must be true or false"
    if isinstance(info, mi.LiteralType):  # in their declared order (msgspec sorts them)
        return "must be one of " + ", ".join(_show(v) for v in get_args(annotation))
    if isinstance(info, mi.IntType):
        return f"must be an integer in [{info.ge}, {info.le}]"
    if isinstance(info, mi.FloatType):  # (gt, le] or [ge, le]
        low = f"({info.gt:g}" if info.gt is not None else f"[{info.ge:g}"
        return f"must be a number in {low}, {info.le:g}]"
    return f"must be a {type(info).__name__.removesuffix('Type').lower()}"


def _port_problem(endpoint: str) -> str | None:
    # ZMQ takes a tcp port modulo 2^16 (":99999" binds 34463): refuse it instead. Too many
    # digits for int() (4300) is out of range too.
    port = endpoint.rpartition(":")[2].lstrip("0")
    if endpoint.startswith("tcp://") and (len(port) > 5 or int(port or 0) > 65535):
        return "has a port out of range: the port must be in [0, 65535] (0: any free one)"
    return None


def exposed(endpoint: str) -> bool:
    """A tcp endpoint on anything but a loopback address: other machines may reach it. A host
    name, an interface or "*" counts as exposed (what it binds is not known here)."""
    if not endpoint.startswith("tcp://"):
        return False  # ipc:// and inproc:// stay on this machine
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    try:
        return host != "localhost" and not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def _check_consistency(config: ServiceConfig, source: str, origins: dict[str, str]) -> None:
    """Rules that tie two keys together. `origins` says where each key set came from."""
    s, sp = config.service, config.spec
    for key in ("client_endpoint", "telemetry_endpoint"):
        where = f"{origins.get(f'service.{key}', source)}: service.{key} = {_show(getattr(s, key))}"
        problem = _port_problem(getattr(s, key))
        if problem:
            raise ConfigError(f"{where} {problem}")
        if exposed(getattr(s, key)) and not (s.curve_keys or s.insecure):
            raise ConfigError(
                f"{where} can be reached from other machines, and without authentication "
                f"anyone who reaches it could use the service and read its telemetry: bind "
                f"a loopback address (tcp://127.0.0.1:PORT), or run `fmserve keys DIR` and set "
                f"service.curve_keys = \"DIR\" (fmserve serve --curve-keys DIR) so that only "
                f"clients holding its keys get in, or, on a network you trust, set "
                f"service.insecure = true (fmserve serve --insecure)")
    if s.curve_keys and s.insecure:
        raise ConfigError(f"{source}: service.insecure = true and service.curve_keys are both "
                          f"set: with CURVE keys the endpoints are not insecure; drop one")
    if sp.draft_model and sp.algorithm == "none":
        # A head given with speculation off used to load nothing and say nothing.
        algorithm = (f"set in {origins['spec.algorithm']}" if "spec.algorithm" in origins
                     else "the default")
        raise ConfigError(
            f"{origins.get('spec.draft_model', source)}: spec.draft_model = "
            f"{_show(sp.draft_model)} names a draft model, but spec.algorithm is \"none\" "
            f"({algorithm}), so speculative decoding is off and the draft model would be "
            f"ignored: set spec.algorithm = \"eagle3\" or \"eagle\" (fmserve serve "
            f"--spec-algorithm eagle3) to use it, or remove spec.draft_model (--draft-model)")
    h = config.http
    if h.enabled and not h.api_key and not is_loopback(h.host):
        raise ConfigError(
            f"{origins.get('http.host', source)}: http.host = {_show(h.host)} would serve the "
            f"HTTP API beyond this machine with no API key: set one (http.api_key in "
            f"config.toml, --api-key, or the FMSERVE_API_KEY environment variable), or bind "
            f"127.0.0.1")
    if s.heartbeat_interval_s >= s.client_timeout_s:
        raise ConfigError(
            f"{source}: service.heartbeat_interval_s = {s.heartbeat_interval_s:g} must be "
            f"smaller than service.client_timeout_s = {s.client_timeout_s:g}, or every client "
            f"would be timed out between two heartbeats")
    if config.parallel.dp_attention and config.parallel.dp > 1:
        raise ConfigError(f"{origins.get('parallel.dp_attention', source)}: parallel."
                          f"dp_attention = true with parallel.dp = {config.parallel.dp} is not "
                          f"built yet (one DP attention group per service): set parallel.dp "
                          f"to 1, or dp_attention to false for {config.parallel.dp} replicas")
    try:
        config.worker_config().validate()
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if s.client_endpoint == s.telemetry_endpoint:
        raise ConfigError(f"{source}: service.client_endpoint and service.telemetry_endpoint "
                          f"are both {s.client_endpoint!r}; they must differ")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _did_you_mean(name: str, known, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _show(value: Any) -> str:
    """A value as it would be written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)
