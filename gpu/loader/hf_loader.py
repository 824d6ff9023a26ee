"""Hugging Face model directories: config.json -> ModelConfig, safetensors -> unfused tensors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from tqdm import tqdm

from gpu.loader.errors import ModelLoadError
from gpu.loader.families import (DEFAULT_LOCAL_ROPE_THETA, Family, hf_family,
                                  pattern_window_layers)
from gpu.model_config import ModelConfig
from gpu.rope_scaling import rope_scaling_from_hf

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"

# HF tensor name (without the "model.layers.{i}." prefix) -> our unfused name.
_LAYER_TENSORS = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
_QKV_BIAS = {"self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
             "self_attn.v_proj.bias": "v_bias"}
_QK_NORM = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
# Gemma's four norms: its post_attention_layernorm is on the attention output, and the norm
# before the MLP (Llama's post_attention_layernorm, our post_attn_norm) is pre_feedforward's.
_SANDWICH_NORMS = {"post_attention_layernorm.weight": "attn_out_norm",
                   "pre_feedforward_layernorm.weight": "post_attn_norm",
                   "post_feedforward_layernorm.weight": "mlp_out_norm"}
# transformers' names of the MLP activations we run (gpu/layers.py GATED_ACTIVATIONS).
_HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _read_json(file: Path) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not read {file}: {e}") from e


def _eos_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def hf_model_config(raw: dict, config_file: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face config.json; ModelLoadError naming the file (and the
    key, where one is at fault) for anything it cannot use."""
    try:
        return _hf_model_config(raw, config_file)
    except ModelLoadError:
        raise
    except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong form
        raise ModelLoadError(f"{config_file}: a value has the wrong type or form "
                             f"({type(e).__name__}: {e}); compare it with the config.json "
                             f"transformers writes for this model type") from e


def _hf_model_config(raw: dict, config_file: Path) -> ModelConfig:
    family = hf_family(raw, config_file)
    for key in ("quantization_config", "rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ModelLoadError(f"{config_file}: '{key}' is {raw[key]!r}; it must be an "
                                 f"object (or be left out)")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ModelLoadError(f"{config_file}: the checkpoint is quantized ({method}); use an "
                             f"unquantized checkpoint or a GGUF file")
    # Biases on o_proj or the MLP (Qwen2's q/k/v biases are no flag: the family has them).
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ModelLoadError(f"{config_file}: '{flag}: true' is not supported")

    def need(key: str):
        if raw.get(key) is None:
            raise ModelLoadError(f"{config_file} lacks the key '{key}'")
        if isinstance(raw[key], str):  # int("12") would take it; transformers would not
            raise ModelLoadError(f"{config_file}: '{key}' is the string {raw[key]!r}; it must "
                                 f"be a number")
        return raw[key]

    hidden = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    _check_family_settings(raw, family, config_file)
    rope_params = raw.get("rope_parameters") or {}  # transformers >= 5 writes this form
    local_params: dict = {}
    if "full_attention" in rope_params or "sliding_attention" in rope_params:
        # Gemma 3 under transformers 5: a rope object per layer type.
        local_params = rope_params.get("sliding_attention") or {}
        rope_params = rope_params.get("full_attention") or {}
    rope_theta = raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    eos = _eos_ids(raw.get("eos_token_id"))
    generation_config = config_file.parent / "generation_config.json"
    if generation_config.is_file():
        eos += _eos_ids(_read_json(generation_config).get("eos_token_id"))
    num_layers = int(need("num_hidden_layers"))
    max_positions = int(raw.get("max_position_embeddings", 2048))
    window, window_layers = _sliding_window(raw, family, num_layers, config_file)
    local_theta = None
    if family.local_rope:
        if rope_scaling_from_hf(local_params, max_positions, config_file) is not None:
            raise ModelLoadError(f"{config_file}: rope scaling on the sliding-window layers is "
                                 f"not supported (only on the full-attention ones)")
        local_theta = float(raw.get("rope_local_base_freq",
                                    local_params.get("rope_theta", DEFAULT_LOCAL_ROPE_THETA)))
    scalar = raw.get("query_pre_attn_scalar")
    softcap = raw.get("final_logit_softcapping")
    return ModelConfig(
        architecture=family.name,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        vocab_size=int(need("vocab_size")),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_context_len=max_positions,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling_from_hf(raw.get("rope_scaling") or rope_params, max_positions,
                                          config_file),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        sliding_window=window,
        window_layers=window_layers,
        local_rope_theta=local_theta,
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        final_logit_softcap=None if softcap is None else float(softcap),
        **family.config_flags(),
    )


def _check_family_settings(raw: dict, family: Family, config_file: Path) -> None:
    """Settings that change the math in ways the decoder does not run, refused by name."""
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if _HF_ACTIVATIONS.get(activation) != family.mlp_activation:
        raise ModelLoadError(f"{config_file}: activation '{activation}' is not supported for "
                             f"{family.name}; it runs {family.mlp_activation}")
    if raw.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{config_file}: attention logit softcapping (Gemma 2's) is not "
                             f"supported")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{config_file}: bidirectional attention is not supported")


def _sliding_window(raw: dict, family: Family, num_layers: int,
                    config_file: Path) -> tuple[int | None, tuple[int, ...] | None]:
    """(the window, the layers it applies to; None: all). Mistral's applies to every layer
    when set; Qwen's only with use_sliding_window, from layer max_window_layers on; Gemma's
    to all but every sliding_window_pattern-th layer. transformers' layer_types, where
    written, says the same and wins."""
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return None, None
    types = raw.get("layer_types")
    if types is None:
        if family.window_pattern is not None:
            pattern = int(raw.get("sliding_window_pattern") or family.window_pattern)
            windowed = pattern_window_layers(pattern, num_layers)
        else:
            first = int(raw.get("max_window_layers") or 0) if "use_sliding_window" in raw else 0
            windowed = tuple(range(first, num_layers))
    else:
        if len(types) != num_layers or not set(types) <= {"sliding_attention",
                                                           "full_attention"}:
            raise ModelLoadError(f"{config_file}: layer_types {types} is not one of "
                                 f"'sliding_attention' / 'full_attention' per layer "
                                 f"({num_layers} layers)")
        windowed = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not windowed:
        return None, None
    return int(window), None if len(windowed) == num_layers else windowed


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Every tensor name in the checkpoint -> the safetensors file that holds it."""
    from safetensors import safe_open

    index = directory / SHARD_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no 'weight_map'; the index file is damaged")
        files = {name: directory / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise ModelLoadError(f"{index} names the shard {file.name}, which is missing from "
                                     f"{directory}; download the model again")
        return files
    single = directory / SINGLE_FILE
    if not single.is_file():
        others = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found {others}: PyTorch .bin checkpoints are not supported)" if others else ""
        raise ModelLoadError(f"{directory} has neither {SINGLE_FILE} nor {SHARD_INDEX}{hint}; "
                             f"expected safetensors weights next to config.json")
    try:
        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as e:
        raise ModelLoadError(f"could not read {single}: {e}; the file looks truncated or "
                             f"corrupt, download it again") from e


def _wanted_tensors(cfg: ModelConfig) -> dict[str, str]:
    """Our unfused name -> the checkpoint's tensor name."""
    wanted = {"embed_tokens": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        wanted["lm_head"] = "lm_head.weight"
    per_layer = (_LAYER_TENSORS | (_QKV_BIAS if cfg.qkv_bias else {})
                 | (_QK_NORM if cfg.qk_norm else {}) | (_SANDWICH_NORMS if cfg.sandwich_norms
                                                        else {}))
    for i in range(cfg.num_layers):
        for hf, ours in per_layer.items():
            wanted[f"layers.{i}.{ours}"] = f"model.layers.{i}.{hf}"
    return wanted


def load_hf_dir(directory: Path, dtype: torch.dtype,
                progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and unfused tensors (our short names, [out, in], `dtype`, CPU)."""
    from safetensors import safe_open

    config_file = directory / "config.json"
    raw = _read_json(config_file)
    config = hf_model_config(raw, config_file)
    files = _tensor_files(directory)
    if "tie_word_embeddings" not in raw and "lm_head.weight" not in files:
        # Not stated and no separate head on disk: the embeddings serve as the head.
        config = dataclasses.replace(config, tie_word_embeddings=True)
    wanted = _wanted_tensors(config)
    listing = directory / (SHARD_INDEX if (directory / SHARD_INDEX).is_file() else SINGLE_FILE)
    for ours, hf in wanted.items():
        if hf not in files:
            raise ModelLoadError(f"{listing} has no tensor '{hf}' (needed for {ours}); the "
                                 f"weights are incomplete or not a {config.architecture} model")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, hf in wanted.items():
        by_file.setdefault(files[hf], []).append((ours, hf))
    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(total=len(wanted), desc=f"loading {directory.name}", unit="tensor",
               disable=not progress)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                for ours, hf in names:
                    weights[ours] = f.get_tensor(hf).to(dtype).contiguous()
                    bar.update(1)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"could not read {file}: {e}; the file looks truncated or "
                                 f"corrupt, download it again") from e
    bar.close()
    return config, weights
