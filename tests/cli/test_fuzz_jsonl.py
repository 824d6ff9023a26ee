"""Property-based fuzzing of JSONL prompt files (`fmserve generate --file`, the benches'
--prompts): whatever a file holds, its reader gives prompts or a ValueError naming the file."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fmserve.generate_cmd import _read_jsonl
from fmserve.jsonl import read_prompts

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["prompt", "messages", "role", "content"]) | st.text(max_size=4), inner,
        max_size=3), max_leaves=8)
lines = st.one_of(json_values.map(json.dumps), st.text(max_size=20),
                  st.sampled_from(["[" * 100_000, '{"prompt": ' + "[" * 100_000, ""]))
files = st.one_of(st.lists(lines, max_size=4).map(lambda ls: "\n".join(ls).encode(
    "utf-8", "surrogatepass")), st.binary(max_size=40))


@FUZZ
@given(files)
@example(b"[" * 100_000)  # nesting too deep for json: a RecursionError got through
@example(b'{"prompt": "\xff"}')
def test_any_jsonl_file_gives_prompts_or_a_value_error_naming_it(tmp_path, data):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(data)
    for read in (read_prompts, lambda p: _read_jsonl(p, raw=False)):
        try:
            prompts = read(str(path))
        except ValueError as exc:
            assert str(path) in str(exc)
            continue
        assert prompts and all(isinstance(p, (str, list)) for p in prompts)
