"""`fmserve client` (and the batch files that `fmserve generate --file` shares with it): bad
input is refused with a message, never a hang or a traceback."""

from __future__ import annotations

import threading

import pytest

from fmserve.cli import main
from tests.ipc.fake_service import FakeService, free_endpoint


def test_client_command_with_no_service_says_so_instead_of_waiting_forever(capsys):
    from fmserve.cli import main

    endpoint = free_endpoint()
    rc: list[int] = []  # in a thread: a client that waits forever must fail the test, not hang it
    waiting = threading.Thread(target=lambda: rc.append(
        main(["client", "--endpoint", endpoint, "--prompt", "hello"])), daemon=True)
    waiting.start()
    waiting.join(30)  # the health check gives up after 5 s
    assert rc == [2], "fmserve client still waits for a service that is not there"
    err = capsys.readouterr().err
    assert err.startswith("fmserve: error: no answer from an fmserve service at " + endpoint)
    assert "Traceback" not in err
    with FakeService() as service:  # with a service there, the check passes unnoticed
        assert main(["client", "--endpoint", service.endpoint, "--prompt", "alpha beta",
                     "--raw"]) == 0
        assert capsys.readouterr().out == "alpha beta\n"


def test_client_command_refuses_bad_flags_and_bad_files(tmp_path, capsys):
    from fmserve.cli import main

    endpoint = free_endpoint()  # nothing listens: every case must fail before connecting
    bad_chat = tmp_path / "chat.jsonl"
    bad_chat.write_text('{"prompt": "fine"}\n{"messages": [{"role": "user"}]}\n')
    assert main(["client", "--endpoint", endpoint, "--file", str(bad_chat)]) == 2
    assert f"{bad_chat}:2: 'messages' must be a non-empty list" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    assert main(["client", "--endpoint", endpoint, "--file", str(latin1)]) == 2
    assert f"{latin1}: not UTF-8 text" in capsys.readouterr().err
    assert main(["client", "--endpoint", endpoint, "--file", str(tmp_path)]) == 2
    assert "Is a directory" in capsys.readouterr().err
    for flags, flag in ([["--concurrency", "0"], "--concurrency"],
                        [["--concurrency", "-3"], "--concurrency"],
                        [["--endpoint", "localhost:5557"], "--endpoint"]):
        with pytest.raises(SystemExit) as info:
            main(["client", "--file", str(bad_chat), *flags])
        assert info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


# ----- `--file`: rows with both prompt and messages, files with no rows -----
# `fmserve client --file` / `generate --file`: a row with both 'prompt' and 'messages', and a
# file with no rows, are refused before anything is sent or loaded.
#
# A row with both was sent as its 'messages' and its 'prompt' dropped without a word; an empty
# file ran nothing and exited 0 (with no service there, the error was "no answer from an fmserve
# service", about something else).

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


# ----- `--output` checked before any work -----
# `--output` of `fmserve client --file` / `fmserve generate --file` is checked before any work.
#
# It was opened only after every request had run: with a service there, a path in a directory
# that does not exist (or a directory) threw away the whole batch's answers, and the error was
# the bare "[Errno 2] No such file or directory" without naming --output.

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
