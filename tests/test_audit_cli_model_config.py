"""--model: a directory whose config.json is JSON but not an object is refused with a message.

`fmserve generate` ended in a traceback ('list' object has no attribute 'get', from the
tokenizer), and `fmserve serve` the same way before its worker started."""

from __future__ import annotations

import pytest

from fmserve.cli import main


@pytest.mark.parametrize("text", ["[1, 2]", '"llama"', "null"])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_config_json_that_is_not_an_object_is_refused(tmp_path, capsys, text, command):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(text)
    from tokenizers import Tokenizer, models  # a real one: the bug came after it loaded
    Tokenizer(models.WordLevel({"w0": 0}, unk_token="w0")).save(str(model / "tokenizer.json"))
    flags = ["--prompt", "hi"] if command == "generate" else [
        "--config", str(tmp_path / "none.toml"), "--endpoint", "tcp://127.0.0.1:0"]
    if command == "serve":
        (tmp_path / "none.toml").write_text("")
    assert main([command, "--model", str(model), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{model / 'config.json'}" in err and "JSON object" in err, err
