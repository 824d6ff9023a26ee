"""`fmserve client --file` / `generate --file`: a row with both 'prompt' and 'messages', and a
file with no rows, are refused before anything is sent or loaded.

A row with both was sent as its 'messages' and its 'prompt' dropped without a word; an empty
file ran nothing and exited 0 (with no service there, the error was "no answer from an fmserve
service", about something else)."""

from __future__ import annotations

import pytest

from fmserve.cli import main
from tests.test_client_local import free_endpoint


@pytest.mark.parametrize("command", ["client", "generate"])
def test_a_row_with_both_prompt_and_messages_is_refused_by_its_line(tmp_path, capsys, command):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "one"}\n\n'
                    '{"prompt": "two", "messages": [{"role": "user", "content": "three"}]}\n')
    where = (["--endpoint", free_endpoint()] if command == "client"
             else ["--model", str(tmp_path / "never-loaded.gguf")])
    assert main([command, *where, "--file", str(rows)]) == 2
    err = capsys.readouterr().err
    assert f"{rows}:3: " in err and "both 'prompt' and 'messages'" in err, err


@pytest.mark.parametrize("command", ["client", "generate"])
@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_a_file_with_no_rows_is_refused(tmp_path, capsys, command, text):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(text)
    where = (["--endpoint", free_endpoint()] if command == "client"
             else ["--model", str(tmp_path / "never-loaded.gguf")])
    assert main([command, *where, "--file", str(rows)]) == 2
    assert f"fmserve: error: {rows}: no prompts" in capsys.readouterr().err
