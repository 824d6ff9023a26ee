"""A draft head's tensors: read from safetensors (or pytorch_model.bin), renamed to one layout,
and checked against its `DraftHeadConfig` (names and shapes)."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu.eagle.draft_head import DraftHeadConfig, DraftHeadError

WEIGHTS_FILE = "model.safetensors"
# Harmless leftovers some exporters write (rope tables are recomputed here).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
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


def normalise_keys(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def check_head_widths(cfg: DraftHeadConfig, tensors: dict[str, torch.Tensor],
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


def check_tensors(cfg: DraftHeadConfig, tensors: dict[str, torch.Tensor], own_embed: bool,
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
