"""RoPE scaling against transformers' own frequencies and cos/sin scale, for every kind we run;
the config.json form round-trips; the kinds we cannot run are refused in words."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from gpu.loader.errors import ModelLoadError
from gpu.rope_scaling import rope_inv_freq, rope_scaling_from_hf

CASES = [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048,
     "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3},
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: p["rope_type"])
@pytest.mark.parametrize("head_dim, theta", [(64, 500000.0), (128, 1000000.0)])
def test_frequencies_match_transformers(params, head_dim, theta):
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                         max_position_embeddings=32768,
                         rope_parameters={"rope_theta": theta} | params)
    ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    scaling = rope_scaling_from_hf(params, 32768, Path("config.json"))
    assert scaling.kind == params["rope_type"]
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), ref_inv_freq.float(),
                               rtol=1e-6, atol=0)
    assert scaling.cos_sin_scale() == pytest.approx(ref_scale)
    assert rope_scaling_from_hf(scaling.to_hf(), 32768, Path("config.json")) == scaling


def test_plain_rope_is_no_scaling():
    assert rope_scaling_from_hf({}, 2048, Path("c.json")) is None
    assert rope_scaling_from_hf({"rope_type": "default", "rope_theta": 1e4}, 2048,
                                Path("c.json")) is None


@pytest.mark.parametrize("params, needle", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported; supported: llama3"),
    ({"rope_type": "longrope", "short_factor": [1]}, "'longrope' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks the key 'low_freq_factor'"),
    ({"rope_type": "linear"}, "lacks 'factor'"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "mscale_all_dim": 0.7}, "mscale"),
])
def test_what_we_cannot_run_is_refused_naming_the_file(params, needle):
    with pytest.raises(ModelLoadError) as e:
        rope_scaling_from_hf(params, 2048, Path("/models/x/config.json"))
    assert "/models/x/config.json" in str(e.value) and needle in str(e.value)
