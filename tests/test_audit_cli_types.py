"""Wrongly typed input is refused up front, in words: a Hugging Face config.json value of the
wrong type names the file (and the key, where one is at fault), with no traceback from deep in
the loader; `bench peers` refuses impossible counts before it runs anything."""

from __future__ import annotations

import json

import pytest

from gpu.loader.hf_loader import ModelLoadError, hf_model_config

GOOD = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 96,
        "eos_token_id": 2}


def test_a_good_config_loads(tmp_path):
    cfg = hf_model_config(GOOD, tmp_path / "config.json")
    assert (cfg.hidden_size, cfg.num_layers, cfg.eos_token_ids) == (64, 2, (2,))


@pytest.mark.parametrize("change, needle", [
    ({"quantization_config": "x"}, "'quantization_config' is 'x'"),
    ({"rope_parameters": "x"}, "'rope_parameters' is 'x'"),
    ({"rope_scaling": [1, 2]}, "'rope_scaling' is [1, 2]"),
    ({"hidden_size": "abc"}, "'hidden_size' is the string 'abc'"),
    ({"eos_token_id": "x"}, "wrong type or form"),
    ({"rms_norm_eps": {"a": 1}}, "wrong type or form"),
])
def test_wrong_types_name_the_file(tmp_path, change, needle):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(GOOD | change))
    with pytest.raises(ModelLoadError) as info:
        hf_model_config(GOOD | change, config_file)
    assert str(config_file) in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize("flag, value", [("--threads", "-1"), ("--prompt-lookup-tokens", "0")])
def test_bench_peers_refuses_impossible_counts_before_running(flag, value):
    # Both ran a whole benchmark with them before (torch given -1 threads, a lookup of 0).
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "fmserve.cli", "bench", "peers", flag, value,
                          "--quick"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and flag in run.stderr, run.stderr[-2000:]
