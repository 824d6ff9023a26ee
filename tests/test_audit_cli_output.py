"""`--output` of `fmserve client --file` / `fmserve generate --file` is checked before any work.

It was opened only after every request had run: with a service there, a path in a directory
that does not exist (or a directory) threw away the whole batch's answers, and the error was
the bare "[Errno 2] No such file or directory" without naming --output."""

from __future__ import annotations

import pytest

from fmserve.cli import main
from tests.test_client_local import FakeService


@pytest.mark.parametrize("where", ["missing-dir/out.jsonl", "."])
def test_client_output_that_cannot_be_written_is_refused_before_any_request(tmp_path, capsys,
                                                                           where):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "alpha beta"}\n{"prompt": "one two"}\n')
    out = tmp_path / where
    with FakeService() as service:
        rc = main(["client", "--endpoint", service.endpoint, "--file", str(prompts), "--raw",
                   "--output", str(out)])
        generated = service.of_type("generate")
    err = capsys.readouterr().err
    assert rc == 2
    assert generated == [], "the requests ran although their answers could not be written"
    assert err.startswith(f"fmserve: error: --output {out}") and "Traceback" not in err


def test_client_output_that_can_be_written_gets_every_answer(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "alpha beta"}\n{"prompt": "one two"}\n')
    out = tmp_path / "out.jsonl"
    with FakeService() as service:
        assert main(["client", "--endpoint", service.endpoint, "--file", str(prompts), "--raw",
                     "--output", str(out)]) == 0
    assert [line.count('"text"') for line in out.read_text().splitlines()] == [1, 1]


def test_generate_output_is_checked_before_the_model_loads(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w3 w4"}\n')
    out = tmp_path / "missing-dir" / "out.jsonl"
    # The model does not exist either: the --output error must come first, before any load.
    rc = main(["generate", "--model", str(tmp_path / "no-model.gguf"), "--file", str(prompts),
               "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"fmserve: error: --output {out}"), err
