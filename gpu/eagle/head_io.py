"""Draft heads on disk: HF-style directories (config.json + safetensors) in, out, and at random.

The layout is the one public heads use (SpecForge / SGLang ``LlamaForCausalLMEagle3``; EAGLE-1's
``LlamaForCausalLMEagle``), so a head trained elsewhere loads here and one trained here loads in
SGLang. Every problem is reported as a DraftHeadError naming the file, the tensor and the fix:
the config in `gpu.eagle.head_config`, the tensors in `gpu.eagle.head_weights`, the reduced
vocabulary in `gpu.eagle.vocab_map`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gpu.eagle.draft_head import (DraftHead, DraftHeadConfig, DraftHeadError,
                                  default_aux_layer_ids)
from gpu.eagle.head_config import (ARCHITECTURES, detect_algorithm, draft_head_config,
                                   read_config_file)
from gpu.eagle.head_weights import (WEIGHTS_FILE, check_head_widths, check_tensors, normalise_keys,
                                    read_weights)
from gpu.eagle.vocab_map import check_vocab_maps
from gpu.model_config import ModelConfig


def load_draft_head(path: str | Path, target: ModelConfig, target_embed: torch.Tensor | None,
                    target_lm_head: torch.Tensor | None, device: torch.device | str,
                    dtype: torch.dtype, parallel_target: tuple | None = None) -> DraftHead:
    """Read an HF-style draft head directory, check it against the target, build the head.

    ``target_lm_head`` None means the target ties its embeddings. ``parallel_target``: the
    target's (embed, lm_head) layers, used instead of its tables (DraftHead).
    """
    directory = Path(path).expanduser()
    if not directory.exists():
        raise DraftHeadError(f"draft head path {directory} does not exist; expected a directory "
                             f"holding config.json and model.safetensors")
    if not directory.is_dir():
        raise DraftHeadError(f"draft head path {directory} is a file; expected a directory "
                             f"holding config.json and model.safetensors")
    raw = read_config_file(directory)
    tensors, where = read_weights(directory)
    tensors = normalise_keys(tensors)
    config_file = directory / "config.json"
    algorithm = detect_algorithm(raw, set(tensors), str(config_file))
    cfg = draft_head_config(raw, target, algorithm, config_file)
    own_embed = "embed_tokens.weight" in tensors
    layer0_input_norm = algorithm == "eagle" and "layers.0.input_layernorm.weight" in tensors
    if algorithm == "eagle3":
        check_head_widths(cfg, tensors, where)
        check_vocab_maps(cfg, tensors, where)
    check_tensors(cfg, tensors, own_embed, layer0_input_norm, where)
    embed = target_embed.to(device=device, dtype=dtype) if target_embed is not None else None
    lm_head = target_lm_head.to(device=device, dtype=dtype) \
        if target_lm_head is not None and algorithm == "eagle" else None
    head = DraftHead(cfg, embed, lm_head, own_embed=own_embed,
                     layer0_input_norm=layer0_input_norm, device=device, dtype=dtype,
                     parallel_target=parallel_target)
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
        raw["rope_scaling"] = cfg.rope_scaling.to_hf()
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
