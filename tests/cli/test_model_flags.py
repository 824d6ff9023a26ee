"""The model flags of the commands, checked before any model loads.

--draft-model given while speculative decoding is off is refused, naming the flag or config key
and what to do (it used to be ignored without a word); --model naming a directory whose
config.json is not a JSON object is refused with a message."""

import pytest

from fmserve.cli import main
from service.config import ConfigError, load_config


def refused(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or {})
    return str(info.value)


def test_config_refuses_a_draft_model_with_speculation_off(tmp_path):
    path = tmp_path / "my.toml"
    path.write_text('[spec]\ndraft_model = "heads/my-eagle3"\n')
    msg = refused(path)
    assert msg.startswith(f"{path}: spec.draft_model = \"heads/my-eagle3\"")
    assert 'spec.algorithm is "none" (the default)' in msg
    assert '"eagle3" or "eagle"' in msg and "remove spec.draft_model" in msg
    # From the command line (--set or --draft-model), against an algorithm set in the file.
    path.write_text('[spec]\nalgorithm = "none"\n')
    msg = refused(path, {"spec.draft_model": "heads/my-eagle3"})
    assert msg.startswith("command line: spec.draft_model")
    assert f"(set in {path})" in msg and "--spec-algorithm" in msg
    # With speculation on the same key is fine (the head itself is checked by fmserve serve).
    cfg = load_config(path, {"spec.draft_model": "heads/my-eagle3", "spec.algorithm": "eagle3"})
    assert cfg.spec.draft_model == "heads/my-eagle3"


@pytest.mark.parametrize("argv, what_to_do", [
    (["serve"], "--spec-algorithm eagle3"),
    (["generate", "--prompt", "hi"], "--spec-algorithm eagle3"),
    (["bench", "offline", "--no-baseline"], "--spec chain"),
    (["bench", "peers", "--quick", "--peers", "hf-b1"], "select an EAGLE peer"),
], ids=["serve", "generate", "bench-offline", "bench-peers"])
def test_cli_refuses_a_draft_model_with_speculation_off(tmp_path, capsys, argv, what_to_do):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    # Never reached with the check; without it, a quick "not found" (serve, generate, bench
    # offline) or a report with no speculative peer (bench peers would run the baseline).
    model = str(tmp_path / "none.gguf")
    assert main([*argv, "--model", model, "--draft-model", str(head)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fmserve: error: ") and str(head) in err
    assert "--draft-model" in err and "ignored" in err and what_to_do in err
    assert "not found" not in err


# ----- --model with a config.json that is not an object -----
# --model: a directory whose config.json is JSON but not an object is refused with a message.
#
# `fmserve generate` ended in a traceback ('list' object has no attribute 'get', from the
# tokenizer), and `fmserve serve` the same way before its worker started.

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
