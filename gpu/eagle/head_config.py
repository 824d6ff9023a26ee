"""A draft head's config.json: read, the algorithm told (EAGLE-3 or EAGLE-1), and parsed into a
`DraftHeadConfig` checked against the target model."""

from __future__ import annotations

import json
from pathlib import Path

from gpu.eagle.draft_head import DraftHeadConfig, DraftHeadError, default_aux_layer_ids
from gpu.model_config import ModelConfig

ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "eagle": "LlamaForCausalLMEagle"}


def read_config_file(directory: Path) -> dict:
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise DraftHeadError(f"draft head directory {directory} has no config.json; a draft head "
                             f"is an HF-style directory holding config.json and "
                             f"model.safetensors")
    try:
        with open(config_file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise DraftHeadError(f"could not read {config_file}: {e}") from e
    if not isinstance(raw, dict):
        raise DraftHeadError(f"{config_file} does not hold a JSON object")
    return raw


def read_head_config(path: str | Path) -> dict:
    """A head directory's config.json, as a dict (a DraftHeadError says what is missing)."""
    return read_config_file(Path(path).expanduser())


def detect_algorithm(raw: dict, keys: set[str], where: str) -> str:
    archs = [str(a) for a in raw.get("architectures") or []]
    if any("Eagle3" in a for a in archs):
        return "eagle3"
    if any(a == "LlamaForCausalLMEagle" for a in archs):
        return "eagle"
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "fc.bias" in keys or any(k.startswith("layers.0.") for k in keys):
        return "eagle"
    raise DraftHeadError(f"{where}: cannot tell whether this is an EAGLE-3 or an EAGLE-1 head "
                         f"(architectures {archs}, no midlayer.* or layers.0.* tensors); set "
                         f"\"architectures\" to [\"LlamaForCausalLMEagle3\"] or "
                         f"[\"LlamaForCausalLMEagle\"] in config.json")


def draft_head_config(raw: dict, target: ModelConfig, algorithm: str,
                      config_file: Path | str = "config.json") -> DraftHeadConfig:
    """A draft config.json (already parsed) -> DraftHeadConfig, checked against the target."""
    def need(key: str):
        if raw.get(key) is None:
            raise DraftHeadError(f"{config_file} lacks the key '{key}'")
        return raw[key]

    hidden = int(need("hidden_size"))
    if hidden != target.hidden_size:
        raise DraftHeadError(f"{config_file}: the draft head's hidden_size is {hidden} but the "
                             f"target model's is {target.hidden_size}; this head was trained for "
                             f"a different model, use a head made for this one")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != target.hidden_size:
        raise DraftHeadError(f"{config_file}: target_hidden_size is {target_hidden} but the "
                             f"target model's hidden size is {target.hidden_size}; use a head "
                             f"made for this model")
    vocab = int(raw.get("vocab_size") or target.vocab_size)
    if vocab != target.vocab_size:
        raise DraftHeadError(f"{config_file}: the draft head's vocab_size is {vocab} but the "
                             f"target model's is {target.vocab_size}; the head was trained with "
                             f"another tokenizer, use a head made for this model")
    layers = int(raw.get("num_hidden_layers") or 1)
    if layers != 1:
        raise DraftHeadError(f"{config_file}: num_hidden_layers is {layers}; only one-layer "
                             f"draft heads (EAGLE-1 and EAGLE-3) are supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise DraftHeadError(f"{config_file}: hidden_act '{raw['hidden_act']}' is not supported "
                             f"(only silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise DraftHeadError(f"{config_file}: '{flag}: true' is not supported")
    heads = int(need("num_attention_heads"))
    rope_params = raw.get("rope_parameters") or {}
    try:
        from gpu.loader.errors import ModelLoadError
        from gpu.rope_scaling import rope_scaling_from_hf
        rope_scaling = rope_scaling_from_hf(raw.get("rope_scaling") or rope_params,
                                            raw.get("max_position_embeddings"), Path(config_file))
    except ModelLoadError as e:
        raise DraftHeadError(str(e)) from e
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    aux: tuple[int, ...] = ()
    if algorithm == "eagle3":
        eagle_cfg = raw.get("eagle_config") or {}
        ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids",
                            raw.get("eagle_aux_hidden_state_layer_ids"))
        aux = default_aux_layer_ids(target.num_layers) if ids is None else \
            tuple(int(i) for i in ids)
        source = "eagle_config.eagle_aux_hidden_state_layer_ids" if ids is not None else \
            f"the default (1, L/2-1, L-4) for L={target.num_layers} target layers"
        bad = [i for i in aux if not 0 <= i <= target.num_layers - 2]
        if bad:
            raise DraftHeadError(f"{config_file}: aux layer ids {list(aux)} (from {source}) "
                                 f"include {bad}, out of range for a target with "
                                 f"{target.num_layers} layers: ids must lie in 0.."
                                 f"{target.num_layers - 2} (the output of layer i is the input "
                                 f"of layer i+1); use a head made for this model")
        if len(set(aux)) != len(aux):
            raise DraftHeadError(f"{config_file}: aux layer ids {list(aux)} (from {source}) "
                                 f"repeat a layer; set distinct ids in eagle_config."
                                 f"eagle_aux_hidden_state_layer_ids")
        aux = tuple(sorted(aux))  # the target captures in layer order, as SGLang's does
    return DraftHeadConfig(
        algorithm=algorithm,
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", target.rms_norm_eps)),
        rope_theta=float(raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        max_position_embeddings=int(raw.get("max_position_embeddings") or target.max_context_len),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=aux,
        rope_scaling=rope_scaling,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
    )
