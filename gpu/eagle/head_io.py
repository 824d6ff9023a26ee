"""Draft heads on disk: HF-style directories (config.json + safetensors) in, out, and at random.

The layout is the one public heads use (SpecForge / SGLang ``LlamaForCausalLMEagle3``; EAGLE-1's
``LlamaForCausalLMEagle``), so a head trained elsewhere loads here and one trained here loads in
SGLang. Every problem is reported as a DraftHeadError naming the file, the tensor and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpu.eagle.draft_head import (DraftHead, DraftHeadConfig, DraftHeadError,
                                  default_aux_layer_ids)
from gpu.model_config import ModelConfig

__all__ = ["DraftHeadError", "load_draft_head", "save_draft_head", "random_draft_head",
           "build_vocab_map", "draft_head_config", "read_head_config"]

ARCHITECTURES = {"eagle3": "LlamaForCausalLMEagle3", "eagle": "LlamaForCausalLMEagle"}
WEIGHTS_FILE = "model.safetensors"
# Harmless leftovers some exporters write (rope tables are recomputed here).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(directory: Path) -> dict:
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
    return _read_config(Path(path).expanduser())


def _read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the checkpoint on CPU, and the file name(s) for messages."""
    files = sorted(directory.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                tensors.update(load_file(file, device="cpu"))
            except Exception as e:
                raise DraftHeadError(f"could not read {file}: {e}; the file looks truncated or "
                                     f"corrupt, download or save the head again") from e
        return tensors, ", ".join(str(f) for f in files)
    bin_file = directory / "pytorch_model.bin"
    if bin_file.is_file():
        try:
            state = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise DraftHeadError(f"could not read {bin_file}: {e}; the file looks truncated, "
                                 f"corrupt or not a plain state dict") from e
        if not isinstance(state, dict):
            raise DraftHeadError(f"{bin_file} does not hold a state dict (name -> tensor)")
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, str(bin_file)
    raise DraftHeadError(f"draft head directory {directory} has no weights: expected "
                         f"{WEIGHTS_FILE} (or other *.safetensors, or pytorch_model.bin) next to "
                         f"config.json")


def _normalise_keys(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name.startswith("model."):  # some exporters keep the HF "model." prefix
            name = name[len("model."):]
        out[name] = t
    if "layers.0.hidden_norm.weight" in out:
        # The speculators / vLLM spelling of an EAGLE-3 head: its one layer is "layers.0".
        out = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t
               for n, t in out.items()}
    return out


def _detect_algorithm(raw: dict, keys: set[str], where: str) -> str:
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
        from gpu.loader.hf_loader import _rope_scaling
        rope_scaling = _rope_scaling(raw.get("rope_scaling") or rope_params, Path(config_file))
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


def _expected_shapes(cfg: DraftHeadConfig, layer0_input_norm: bool) -> dict[str, tuple[int, ...]]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if cfg.algorithm == "eagle3":
        p, attn_in = "midlayer.", 2 * h
        shapes = {"fc.weight": (h, cfg.input_hidden_size), "norm.weight": (h,),
                  "lm_head.weight": (cfg.draft_vocab_size, h), "d2t": (cfg.draft_vocab_size,),
                  "t2d": (cfg.vocab_size,),
                  p + "input_layernorm.weight": (h,), p + "hidden_norm.weight": (h,)}
    else:
        p, attn_in = "layers.0.", h
        shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,)}
        if layer0_input_norm:
            shapes[p + "input_layernorm.weight"] = (h,)
    shapes.update({
        p + "self_attn.q_proj.weight": (q, attn_in), p + "self_attn.k_proj.weight": (kv, attn_in),
        p + "self_attn.v_proj.weight": (kv, attn_in), p + "self_attn.o_proj.weight": (h, q),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    })
    return shapes


def _vocab_maps(cfg: DraftHeadConfig, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Fill in / check d2t and t2d (eagle3). t2d is rebuilt from d2t, the map decoding uses."""
    dv, vocab = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in tensors:
        if dv != vocab:
            raise DraftHeadError(f"{where}: the head has a reduced vocabulary (draft_vocab_size "
                                 f"{dv} < vocab_size {vocab}) but no 'd2t' tensor mapping draft "
                                 f"ids to target ids; the checkpoint is incomplete")
        tensors["d2t"] = torch.zeros(dv, dtype=torch.int64)
    d2t = tensors["d2t"]
    if d2t.dim() != 1 or d2t.shape[0] != dv:
        raise DraftHeadError(f"{where}: 'd2t' has shape {tuple(d2t.shape)}, but draft_vocab_size "
                             f"{dv} needs ({dv},); config.json and the weights disagree")
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise DraftHeadError(f"{where}: 'd2t' holds {d2t.dtype}; it must hold integer offsets")
    d2t = d2t.to(torch.int64)
    targets = torch.arange(dv) + d2t
    if dv and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise DraftHeadError(f"{where}: 'd2t' maps draft ids outside the target vocabulary "
                             f"(0..{vocab - 1}); the head was made for another tokenizer")
    if "t2d" in tensors and tuple(tensors["t2d"].shape) != (vocab,):
        raise DraftHeadError(f"{where}: 't2d' has shape {tuple(tensors['t2d'].shape)}, but "
                             f"vocab_size {vocab} needs ({vocab},)")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors["d2t"], tensors["t2d"] = d2t, t2d


def _check_head_widths(cfg: DraftHeadConfig, tensors: dict[str, torch.Tensor],
                       where: str) -> None:
    """The two EAGLE-3 mismatches people actually hit, told apart before the generic checks."""
    lm_head = tensors.get("lm_head.weight")
    if lm_head is not None and lm_head.dim() == 2 and lm_head.shape[0] != cfg.draft_vocab_size:
        raise DraftHeadError(f"{where}: 'lm_head.weight' has {lm_head.shape[0]} rows but "
                             f"config.json says draft_vocab_size {cfg.draft_vocab_size}; set "
                             f"draft_vocab_size to the lm_head's rows, or use matching files")
    fc = tensors.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] != cfg.input_hidden_size \
            and fc.shape[1] % cfg.hidden_size == 0:
        raise DraftHeadError(f"{where}: 'fc.weight' reads {fc.shape[1] // cfg.hidden_size} "
                             f"concatenated hidden states but the aux layer ids "
                             f"{list(cfg.aux_layer_ids)} give {len(cfg.aux_layer_ids)}; set "
                             f"eagle_config.eagle_aux_hidden_state_layer_ids in config.json")


def _check_tensors(cfg: DraftHeadConfig, tensors: dict[str, torch.Tensor], own_embed: bool,
                   layer0_input_norm: bool, where: str) -> None:
    expected = _expected_shapes(cfg, layer0_input_norm)
    if own_embed:
        expected["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise DraftHeadError(f"{where}: the {cfg.algorithm} head lacks the tensor(s) "
                             f"{', '.join(missing)}; the checkpoint is incomplete or of another "
                             f"layout")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise DraftHeadError(f"{where}: unexpected tensor(s) {', '.join(extra)} for an "
                             f"{cfg.algorithm} head; the checkpoint is of another layout (check "
                             f"\"architectures\" in config.json)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise DraftHeadError(f"{where}: tensor '{name}' has shape {tuple(tensors[name].shape)} "
                                 f"but config.json implies {shape}; the weights and config.json "
                                 f"disagree")


def load_draft_head(path: str | Path, target: ModelConfig, target_embed: torch.Tensor,
                    target_lm_head: torch.Tensor | None, device: torch.device | str,
                    dtype: torch.dtype) -> DraftHead:
    """Read an HF-style draft head directory, check it against the target, build the head.

    ``target_lm_head`` None means the target ties its embeddings.
    """
    directory = Path(path).expanduser()
    if not directory.exists():
        raise DraftHeadError(f"draft head path {directory} does not exist; expected a directory "
                             f"holding config.json and model.safetensors")
    if not directory.is_dir():
        raise DraftHeadError(f"draft head path {directory} is a file; expected a directory "
                             f"holding config.json and model.safetensors")
    raw = _read_config(directory)
    tensors, where = _read_weights(directory)
    tensors = _normalise_keys(tensors)
    config_file = directory / "config.json"
    algorithm = _detect_algorithm(raw, set(tensors), str(config_file))
    cfg = draft_head_config(raw, target, algorithm, config_file)
    own_embed = "embed_tokens.weight" in tensors
    layer0_input_norm = algorithm == "eagle" and "layers.0.input_layernorm.weight" in tensors
    if algorithm == "eagle3":
        _check_head_widths(cfg, tensors, where)
        _vocab_maps(cfg, tensors, where)
    _check_tensors(cfg, tensors, own_embed, layer0_input_norm, where)
    embed = target_embed.to(device=device, dtype=dtype) if target_embed is not None else None
    lm_head = target_lm_head.to(device=device, dtype=dtype) \
        if target_lm_head is not None and algorithm == "eagle" else None
    head = DraftHead(cfg, embed, lm_head, own_embed=own_embed,
                     layer0_input_norm=layer0_input_norm, device=device, dtype=dtype)
    head.load_state_dict(tensors, strict=True)  # copies, casting to the head's dtype
    return head.eval()


def save_draft_head(head: DraftHead, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
    """Write config.json and model.safetensors (floats in ``dtype``), public tensor names only."""
    from safetensors.torch import save_file

    cfg = head.config
    directory = Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    raw = {
        "architectures": [ARCHITECTURES[cfg.algorithm]],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        raw["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                               "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings":
                                   s.original_max_position_embeddings}
    if cfg.norm_before_residual:
        raw["norm_before_residual"] = True
    if cfg.algorithm == "eagle3":
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}
    tensors = {}
    for name, t in head.state_dict().items():
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    with open(directory / "config.json", "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")


def random_draft_head(target: ModelConfig, target_embed: torch.Tensor,
                      target_lm_head: torch.Tensor | None, algorithm: str = "eagle3",
                      draft_vocab_size: int | None = None, seed: int = 0,
                      device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                      aux_layer_ids: tuple[int, ...] | None = None,
                      intermediate_size: int | None = None) -> DraftHead:
    """A randomly initialised head shaped like the target's layers (for tests, and as a start
    for training). Init as HF's: linear weights normal(0, 0.02), biases 0, norms 1; drawn on
    CPU from ``seed``, so the same seed gives the same head on any device. A reduced draft
    vocabulary keeps the first ``draft_vocab_size`` ids until build_vocab_map picks better ones.
    ``intermediate_size``: the decoder layer's MLP width (default: the target's); any width
    keeps the public one-layer layout, since config.json carries it.
    """
    vocab = target.vocab_size
    aux: tuple[int, ...] = ()
    if algorithm == "eagle3":
        aux = tuple(aux_layer_ids) if aux_layer_ids is not None else \
            default_aux_layer_ids(target.num_layers)
        bad = [i for i in aux if not 0 <= i <= target.num_layers - 2]
        if bad:
            raise DraftHeadError(f"aux layer ids {list(aux)} include {bad}, out of range for a "
                                 f"target with {target.num_layers} layers (0.."
                                 f"{target.num_layers - 2}); pass aux_layer_ids")
    cfg = DraftHeadConfig(
        algorithm=algorithm, hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
        max_position_embeddings=target.max_context_len, vocab_size=vocab,
        draft_vocab_size=draft_vocab_size if draft_vocab_size is not None else vocab,
        aux_layer_ids=aux, rope_scaling=target.rope_scaling)
    embed = target_embed.to(device=device, dtype=dtype)
    lm_head = target_lm_head.to(device=device, dtype=dtype) \
        if target_lm_head is not None and algorithm == "eagle" else None
    head = DraftHead(cfg, embed, lm_head, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen))
    return head


def build_vocab_map(token_counts: torch.Tensor,
                    draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``draft_vocab_size`` most frequent target ids (ties: lower id first), ascending.

    Returns d2t [draft_vocab] int64 (target_id = draft_id + d2t[draft_id]) and t2d [vocab] bool.
    """
    counts = token_counts.detach().flatten().to("cpu")
    vocab = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab:
        raise DraftHeadError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab} (the "
                             f"length of token_counts)")
    order = torch.sort(counts, descending=True, stable=True).indices[:draft_vocab_size]
    kept = order.sort().values.to(torch.int64)
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
