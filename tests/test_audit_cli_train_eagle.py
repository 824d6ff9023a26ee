"""`fmserve train-eagle`: an --out that cannot hold the head, and prompt files with nothing to
use, are refused before any stage runs (and leave no data behind).

- --out naming an existing file was found when training wrote its first checkpoint's head (50
  steps in by default; with --stage all after the whole data stage), as a bare
  "[Errno 17] File exists".
- A --prompts file with no rows (or none that fit --max-prompt-tokens) made a "complete" data
  set of 0 shards and exit 0; that empty set then locked the work dir (a later run with a good
  file was refused as "data made with another selection") and training said only "no complete
  shard yet". An empty --eval-prompts file gave an evaluation of 0 prompts, exit 0."""

from __future__ import annotations

import pytest

from fmserve.cli import main


def _run(tmp_path, *flags) -> int:
    return main(["train-eagle", "--work-dir", str(tmp_path / "work"), "--no-progress",
                 "--device", "cpu", *flags])


def test_out_that_is_a_file_is_refused_before_any_stage(tmp_path, tiny_llama, capsys):
    out = tmp_path / "head"
    out.write_text("not a directory")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w3 w4"}\n')
    for stage in ("all", "train", "eval"):
        rc = _run(tmp_path, "--model", str(tiny_llama), "--stage", stage, "--out", str(out),
                  "--prompts", str(prompts), "--eval-prompts", str(prompts))
        err = capsys.readouterr().err
        assert rc == 2 and f"--out {out} is a file" in err, (stage, err)
        assert not (tmp_path / "work" / "data").exists()
    inside = out / "sub"  # its parent a file: mkdir fails the same way
    assert _run(tmp_path, "--model", str(tiny_llama), "--stage", "train",
                "--out", str(inside)) == 2
    assert f"--out {inside}" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_empty_prompt_files_are_refused_before_the_model_loads(tmp_path, capsys, text):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    model = str(tmp_path / "no-model.gguf")  # never reached: the file is checked first
    assert _run(tmp_path, "--model", model, "--stage", "data", "--prompts", str(empty)) == 2
    assert f"--prompts: {empty}: no prompts" in capsys.readouterr().err
    assert _run(tmp_path, "--model", model, "--stage", "eval", "--eval-prompts", str(empty)) == 2
    assert f"--eval-prompts: {empty}: no prompts" in capsys.readouterr().err
    # --stage all evaluates after hours of data and training: its eval file is checked first.
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "w3"}\n')
    assert _run(tmp_path, "--model", model, "--prompts", str(good),
                "--eval-prompts", str(empty)) == 2
    assert f"--eval-prompts: {empty}: no prompts" in capsys.readouterr().err
    assert _run(tmp_path, "--model", model, "--stage", "data",
                "--prompts", str(tmp_path / "missing.jsonl")) == 2
    assert "--prompts: " in capsys.readouterr().err


def test_prompts_that_all_exceed_max_prompt_tokens_make_no_data(tmp_path, tiny_llama, capsys):
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "' + " ".join(["w5"] * 40) + '"}\n')
    assert _run(tmp_path, "--model", str(tiny_llama), "--stage", "data", "--dtype", "fp32",
                "--prompts", str(long), "--max-prompt-tokens", "8") == 2
    err = capsys.readouterr().err
    assert "none of the 1 prompts" in err and "--max-prompt-tokens 8" in err, err
    assert not (tmp_path / "work" / "data" / "manifest.json").exists()
