"""The service's configuration: config.toml, then command-line overrides, checked strictly.

    cfg = load_config(Path("config.toml"), {"runtime.page_size": args.page_size})

Every key has a type and an allowed range or set of choices, declared next to its default.
Unknown sections and keys are refused rather than ignored (a typo would otherwise silently
leave a default in place), and every error names the file, the dotted key and what is allowed:

    config.toml: runtime.page_size = 0 is out of range: must be an integer in [1, 1024]
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipc.client_messages import MAX_MESSAGE_BYTES
from ipc.spec_settings import SpecSettings


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says where and why."""


# ----- rules: what a key accepts ------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """Checks one value; `check` returns the value to store or raises `_Refused`."""

    def check(self, value: Any) -> Any:
        raise NotImplementedError


class _Refused(Exception):
    def __init__(self, problem: str, allowed: str) -> None:
        self.problem, self.allowed = problem, allowed  # "is out of range", "must be ..."


@dataclass(frozen=True)
class IntIn(Rule):
    lo: int
    hi: int

    def check(self, value: Any) -> int:
        allowed = f"must be an integer in [{self.lo}, {self.hi}]"
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Refused("has the wrong type", allowed)
        if not self.lo <= value <= self.hi:
            raise _Refused("is out of range", allowed)
        return value


@dataclass(frozen=True)
class FloatIn(Rule):
    lo: float  # exclusive: every float key here is a duration or interval, so 0 is no answer
    hi: float

    def check(self, value: Any) -> float:
        allowed = f"must be a number in ({self.lo:g}, {self.hi:g}]"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Refused("has the wrong type", allowed)
        if not (math.isfinite(value) and self.lo < value <= self.hi):
            raise _Refused("is out of range", allowed)
        return float(value)


@dataclass(frozen=True)
class Boolean(Rule):
    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise _Refused("has the wrong type", "must be true or false")
        return value


@dataclass(frozen=True)
class OneOf(Rule):
    choices: tuple[str, ...]

    def check(self, value: Any) -> str:
        allowed = "must be one of " + ", ".join(f'"{c}"' for c in self.choices)
        if not isinstance(value, str):
            raise _Refused("has the wrong type", allowed)
        if value not in self.choices:
            raise _Refused("is not a valid choice", allowed)
        return value


@dataclass(frozen=True)
class Matches(Rule):
    pattern: str
    allowed: str  # for people: what the pattern means

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise _Refused("has the wrong type", self.allowed)
        if not re.fullmatch(self.pattern, value):
            raise _Refused("is not valid", self.allowed)
        return value


def _key(default: Any, rule: Rule) -> Any:
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True)
class Endpoint(Matches):
    def check(self, value: Any) -> str:
        super().check(value)
        # ZMQ takes a tcp port modulo 2^16 (":99999" binds 34463): refuse it instead.
        if value.startswith("tcp://") and int(value.rpartition(":")[2]) > 65535:
            raise _Refused("has a port out of range", "the port must be in [0, 65535] "
                           "(0: any free one)")
        return value


ENDPOINT = Endpoint(r"(tcp://[^\s:]+:\d+|ipc://\S+|inproc://\S+)",
                    'must be a ZMQ endpoint such as "tcp://127.0.0.1:5557" or "ipc:///tmp/fm"')

# ----- sections ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServiceSection:
    client_endpoint: str = _key("tcp://127.0.0.1:5557", ENDPOINT)
    telemetry_endpoint: str = _key("tcp://127.0.0.1:5558", ENDPOINT)
    telemetry_interval_s: float = _key(0.25, FloatIn(0.0, 60.0))
    client_timeout_s: float = _key(10.0, FloatIn(0.0, 3600.0))
    heartbeat_interval_s: float = _key(2.0, FloatIn(0.0, 600.0))
    max_message_bytes: int = _key(MAX_MESSAGE_BYTES, IntIn(1 << 10, 1 << 30))


@dataclass(frozen=True)
class ModelSection:
    path: str = _key("default", Matches(r".*\S.*", 'must be a .gguf file, a Hugging Face '
                                        'model directory or "default"'))
    device: str = _key("auto", Matches(r"auto|cpu|cuda(:\d+)?",
                                       'must be "auto", "cpu", "cuda" or "cuda:N"'))
    dtype: str = _key("auto", OneOf(("auto", "bf16", "fp16", "fp32")))


@dataclass(frozen=True)
class RuntimeSection:
    attention_backend: str = _key("torch", OneOf(("torch", "triton")))
    page_size: int = _key(16, IntIn(1, 1024))
    max_kv_tokens: int = _key(65536, IntIn(1, 1 << 26))
    max_running_requests: int = _key(64, IntIn(1, 4096))
    max_tokens_per_step: int = _key(2048, IntIn(1, 1 << 20))
    max_context_len: int = _key(0, IntIn(0, 1 << 24))  # 0 = the model's own limit
    wrwr_check: bool = _key(False, Boolean())  # FutureMap write/read invariant checks (debug)
    sync_check: bool = _key(False, Boolean())  # no host sync while launching (debug)
    worker_cpu_threads: int = _key(0, IntIn(0, 1024))  # 0 = auto (see server.py)
    q4_max_tokens: int = _key(12, IntIn(0, 4096))  # 0 = never (see gpu/q4_linear.py)
    cuda_graph_max_batch: int = _key(0, IntIn(0, 4096))  # 0 = never (gpu/decode_graphs.py)


@dataclass(frozen=True)
class SchedulingSection:
    overlap: bool = _key(True, Boolean())
    launch_ahead: str = _key("off", OneOf(("auto", "on", "prepare", "off")))
    prefix_cache: bool = _key(False, Boolean())  # reuse KV pages of shared prompt prefixes


@dataclass(frozen=True)
class SpecSection:
    algorithm: str = _key("none", OneOf(("none", "eagle3", "eagle")))
    draft_model: str = _key("", Matches(r".*", "must be a head directory, or empty"))
    num_steps: int = _key(3, IntIn(1, 16))
    topk: int = _key(1, IntIn(1, 8))
    num_draft_tokens: int = _key(4, IntIn(2, 64))
    disable_above_batch_size: int = _key(0, IntIn(0, 1 << 16))


@dataclass(frozen=True)
class WorkerSection:
    ready_timeout_s: float = _key(300.0, FloatIn(0.0, 86400.0))
    step_timeout_s: float = _key(120.0, FloatIn(0.0, 86400.0))
    restart_on_failure: bool = _key(True, Boolean())
    max_restarts: int = _key(3, IntIn(0, 1000))


@dataclass(frozen=True)
class ServiceConfig:
    service: ServiceSection = field(default_factory=ServiceSection)
    model: ModelSection = field(default_factory=ModelSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    scheduling: SchedulingSection = field(default_factory=SchedulingSection)
    spec: SpecSection = field(default_factory=SpecSection)
    worker: WorkerSection = field(default_factory=WorkerSection)


SECTIONS: dict[str, type] = {
    "service": ServiceSection, "model": ModelSection, "runtime": RuntimeSection,
    "scheduling": SchedulingSection, "spec": SpecSection, "worker": WorkerSection,
}


def _rules(section_cls: type) -> dict[str, Rule]:
    return {f.name: f.metadata["rule"] for f in dataclasses.fields(section_cls)}


def all_keys() -> list[str]:
    """Every dotted key, in file order ("service.client_endpoint", ...)."""
    return [f"{s}.{k}" for s, cls in SECTIONS.items() for k in _rules(cls)]


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
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
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
        for section, table in raw.items():
            _known_section(source, section)
            if not isinstance(table, dict):
                raise ConfigError(f"{source}: {section} must be a table ([{section}]), "
                                  f"not a single value")
            for key, value in table.items():
                values[section][key] = _checked(source, section, key, value)
                origins[f"{section}.{key}"] = source
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r}: keys are written section.key, "
                              f"e.g. runtime.page_size")
        _known_section("command line", section)
        values[section][key] = _checked("command line", section, key, value)
        origins[dotted] = "command line"

    config = ServiceConfig(**{name: SECTIONS[name](**v) for name, v in values.items()})
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
        return ENDPOINT.check(value)
    except _Refused as refused:
        raise ConfigError(f"{_show(value)} {refused.problem}: {refused.allowed}") from None


def _known_section(source: str, section: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section [{section}]{_did_you_mean(section, SECTIONS)}"
                          f"; the sections are: {', '.join(f'[{s}]' for s in SECTIONS)}")


def _checked(source: str, section: str, key: str, value: Any) -> Any:
    rules = _rules(SECTIONS[section])
    if key not in rules:
        hint = _did_you_mean(key, rules, prefix=f"{section}.")
        raise ConfigError(f"{source}: unknown key {section}.{key}{hint}; "
                          f"[{section}] has: {', '.join(rules)}")
    try:
        return rules[key].check(value)
    except _Refused as refused:
        raise ConfigError(f"{source}: {section}.{key} = {_show(value)} {refused.problem}: "
                          f"{refused.allowed}") from None


def _check_consistency(config: ServiceConfig, source: str,
                       origins: dict[str, str] | None = None) -> None:
    """Rules that tie two keys together. `origins` says where each key set came from."""
    s, r, sp = config.service, config.runtime, config.spec
    origins = origins or {}
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
    if s.heartbeat_interval_s >= s.client_timeout_s:
        raise ConfigError(
            f"{source}: service.heartbeat_interval_s = {s.heartbeat_interval_s:g} must be "
            f"smaller than service.client_timeout_s = {s.client_timeout_s:g}, or every client "
            f"would be timed out between two heartbeats")
    if r.max_kv_tokens < r.page_size:
        raise ConfigError(f"{source}: runtime.max_kv_tokens = {r.max_kv_tokens} must be at "
                          f"least runtime.page_size = {r.page_size} (one page)")
    try:
        spec_settings(config).validate()
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if s.client_endpoint == s.telemetry_endpoint:
        raise ConfigError(f"{source}: service.client_endpoint and service.telemetry_endpoint "
                          f"are both {s.client_endpoint!r}; they must differ")


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


def spec_settings(config: ServiceConfig) -> SpecSettings:
    sp = config.spec
    return SpecSettings(sp.algorithm, sp.draft_model, sp.num_steps, sp.topk, sp.num_draft_tokens,
                        sp.disable_above_batch_size)
