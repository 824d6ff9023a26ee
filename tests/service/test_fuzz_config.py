"""Property-based fuzzing of config.toml and --set overrides: whatever the text or the values,
`load_config` gives a ServiceConfig or a ConfigError (a message for people), nothing else."""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service.config import SECTIONS, ConfigError, ServiceConfig, load_config, parse_set_flags

FUZZ = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
KEYS = sorted({k for cls in SECTIONS.values() for k in cls.__struct_fields__})

scalars = st.one_of(st.booleans(), st.integers(-2, 70_000), st.integers(-2**70, 2**70),
                    st.floats(), st.text(max_size=12),
                    st.sampled_from(["tcp://127.0.0.1:9" + "9" * 4400, "tcp://h:0",
                                     "ipc:///tmp/x", "cpu", "eagle3", "on", "bf16"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=6)
# Mostly known sections with their own keys (so values reach the type and range checks),
# sometimes an unknown section or key, or a section that is a single value.
known = st.sampled_from(list(SECTIONS)).flatmap(lambda name: st.tuples(
    st.just(name), st.dictionaries(st.sampled_from(SECTIONS[name].__struct_fields__)
                                   | st.text(max_size=6), values, max_size=3)))
odd = st.tuples(st.text(max_size=6) | st.sampled_from(list(SECTIONS)),
                st.dictionaries(st.text(max_size=6), values, max_size=2) | scalars)
sections = st.lists(known | known | odd, max_size=3).map(dict)


def quoted(text: str) -> str:
    # A JSON string is a TOML basic string, but for JSON's surrogate-pair escapes
    return json.dumps(text, ensure_ascii=False)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return quoted(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{quoted(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_text(doc: dict) -> str:
    lines = []
    for name, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{quoted(name)}]")
            lines += [f"{quoted(k)} = {toml_value(v)}" for k, v in table.items()]
        else:
            lines.insert(0, f"{quoted(name)} = {toml_value(table)}")
    return "\n".join(lines) + "\n"


def check_load(*args) -> None:
    try:
        assert isinstance(load_config(*args), ServiceConfig)
    except ConfigError as exc:
        assert str(exc)


@FUZZ
@given(st.one_of(sections.map(toml_text), st.text(max_size=80)))
@example('[service]\nclient_endpoint = "tcp://127.0.0.1:' + "9" * 4400 + '"\n')
@example("[runtime]\npage_size = 170141183460469231731687303715884105727\n")
def test_any_config_file_loads_or_is_a_config_error(tmp_path, text):
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    check_load(path)


@FUZZ
@given(st.binary(max_size=40))
def test_any_bytes_as_a_config_file_load_or_are_a_config_error(tmp_path, data):
    path = tmp_path / "config.toml"
    path.write_bytes(data)
    check_load(path)


@FUZZ
@given(st.dictionaries(st.builds(lambda s, k: f"{s}.{k}", st.sampled_from(list(SECTIONS)),
                                 st.sampled_from(KEYS)) | st.text(max_size=10), values,
                       max_size=4))
def test_any_overrides_load_or_are_a_config_error(overrides):
    check_load(None, overrides)


@FUZZ
@given(st.lists(st.text(max_size=30), max_size=4))
def test_any_set_flags_parse_and_load_or_are_a_config_error(flags):
    try:
        overrides = parse_set_flags(flags)
    except ConfigError:
        return
    check_load(None, overrides)
