"""Load a model from a path, whatever its format, into the one layout the runtime reads.

Both loaders hand back *unfused* tensors under short names (`layers.{i}.q_proj`, ...),
already in `[out_features, in_features]` layout, on CPU, in the requested dtype. Here they are
checked against the config and fused, so a forward does one matmul for q/k/v and one for
gate/up instead of five:

    embed_tokens                  [vocab, hidden]
    layers.{i}.input_norm         [hidden]
    layers.{i}.qkv_proj           [q_size + 2 * kv_size, hidden]   rows: q, then k, then v
    layers.{i}.o_proj             [hidden, q_size]
    layers.{i}.post_attn_norm     [hidden]
    layers.{i}.gate_up_proj       [2 * intermediate, hidden]       rows: gate, then up
    layers.{i}.down_proj          [hidden, intermediate]
    final_norm                    [hidden]
    lm_head                       [vocab, hidden]                  only when embeddings are untied
    layers.{i}.qkv_bias           [q_size + 2 * kv_size]           only with config.qkv_bias
    layers.{i}.qk_norm            [num_heads + num_kv_heads, head_dim]  only with config.qk_norm:
                                  q's norm repeated per head, then k's
    layers.{i}.attn_out_norm      [hidden]    only with config.sandwich_norms (Gemma 3): the norm
    layers.{i}.mlp_out_norm       [hidden]    of o_proj's / down_proj's output

`post_attn_norm` is the norm before the MLP, whatever the file calls it (Gemma's
pre_feedforward_layernorm). Norm weights are as stored: with config.norm_adds_one the model
scales by 1 + w (gpu/llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu.loader.errors import ModelLoadError
from gpu.loader.families import SUPPORTED_GGUF, SUPPORTED_HF
from gpu.loader.gguf_q4 import Q4Blocks
from gpu.model_config import ModelConfig

ACCEPTED = (f"a .gguf file (architecture {' / '.join(SUPPORTED_GGUF)}), or a Hugging Face model "
            f"directory ({SUPPORTED_HF}) holding config.json and model.safetensors (or a "
            f"sharded model.safetensors.index.json)")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    source: Path
    # Fused projections whose every part the file stores as Q4_0/Q4_1 (`keep_q4` only):
    # their 4-bit codes, for small-batch matmuls on the file's own weights.
    q4: dict[str, Q4Blocks] = field(default_factory=dict)
    # The lm_head (or the tied embedding) as 4-bit parts that sum to it, when the file stores
    # it as Q4_0/Q4_1/Q8_0 (`keep_q4` only; see gpu/loader/gguf_q4.py).
    lm_head_q4: list[Q4Blocks] = field(default_factory=list)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               progress: bool = True, keep_q4: bool = False) -> LoadedModel:
    """Read a GGUF file or an HF directory; raises ModelLoadError with a readable message.
    `keep_q4`: also keep a GGUF's Q4_0/Q4_1 projection codes (LoadedModel.q4) and its
    lm_head's 4-bit parts (LoadedModel.lm_head_q4)."""
    q4: dict[str, Q4Blocks] = {}
    lm_head_q4: list[Q4Blocks] = []
    source = Path(path).expanduser()
    if not source.exists():
        raise ModelLoadError(f"model path {source} does not exist; expected {ACCEPTED}")
    if source.is_file() and source.suffix.lower() == ".gguf":
        from gpu.loader.gguf_loader import load_gguf
        config, unfused, q4, lm_head_q4 = load_gguf(source, dtype, progress, keep_q4)
    elif source.is_dir() and (source / "config.json").is_file():
        from gpu.loader.hf_loader import load_hf_dir
        config, unfused = load_hf_dir(source, dtype, progress)
    elif source.is_dir():
        ggufs = sorted(p.name for p in source.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass that file itself)" if ggufs else ""
        raise ModelLoadError(f"directory {source} has no config.json, so it is not a Hugging Face "
                             f"model directory{hint}; expected {ACCEPTED}")
    else:
        raise ModelLoadError(f"cannot load {source}: expected {ACCEPTED}")
    weights = fuse_weights(config, unfused, source)
    return LoadedModel(config=config, weights=weights, source=source,
                       q4=fuse_q4_blocks(config, q4), lm_head_q4=lm_head_q4)


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens": (cfg.vocab_size, h),
        "final_norm": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    per_layer = {
        "input_norm": (h,), "post_attn_norm": (h,),
        "q_proj": (cfg.q_size, h), "k_proj": (cfg.kv_size, h), "v_proj": (cfg.kv_size, h),
        "o_proj": (h, cfg.q_size),
        "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter),
    }
    if cfg.qkv_bias:
        per_layer |= {"q_bias": (cfg.q_size,), "k_bias": (cfg.kv_size,), "v_bias": (cfg.kv_size,)}
    if cfg.qk_norm:
        per_layer |= {"q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}
    if cfg.sandwich_norms:
        per_layer |= {"attn_out_norm": (h,), "mlp_out_norm": (h,)}
    for i in range(cfg.num_layers):
        for name, shape in per_layer.items():
            shapes[f"layers.{i}.{name}"] = shape
    return shapes


def fuse_weights(cfg: ModelConfig, unfused: dict[str, torch.Tensor],
                 source: Path) -> dict[str, torch.Tensor]:
    """Check every tensor's shape against the config, then fuse q/k/v and gate/up per layer.

    Tensors are popped from `unfused` as they are fused, so peak memory stays near one copy.
    """
    expected = _expected_shapes(cfg)
    extra = sorted(set(unfused) - set(expected) - {"lm_head"})
    if extra:
        raise ModelLoadError(f"{source}: weights {extra} have no place in a {cfg.architecture} "
                             f"model; the file's architecture and tensors disagree")
    for name, shape in expected.items():
        if name not in unfused:
            raise ModelLoadError(f"{source}: weight '{name}' is missing (the loader produced no "
                                 f"such tensor); the model file is incomplete or not a "
                                 f"{cfg.architecture} model")
        if tuple(unfused[name].shape) != shape:
            raise ModelLoadError(f"{source}: weight '{name}' has shape "
                                 f"{tuple(unfused[name].shape)}, but the model config implies "
                                 f"{shape}; the file and its config disagree")
    fused: dict[str, torch.Tensor] = {}
    for name in ("embed_tokens", "final_norm", "lm_head"):
        if name in unfused and (name != "lm_head" or not cfg.tie_word_embeddings):
            fused[name] = unfused.pop(name).contiguous()
    unfused.pop("lm_head", None)  # tied: the runtime reuses embed_tokens
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        take = lambda n: unfused.pop(p + n)  # noqa: E731
        fused[p + "input_norm"] = take("input_norm").contiguous()
        fused[p + "qkv_proj"] = torch.cat([take("q_proj"), take("k_proj"), take("v_proj")], dim=0)
        if cfg.qkv_bias:
            fused[p + "qkv_bias"] = torch.cat([take("q_bias"), take("k_bias"), take("v_bias")])
        if cfg.qk_norm:
            fused[p + "qk_norm"] = torch.cat([take("q_norm").expand(cfg.num_heads, -1),
                                              take("k_norm").expand(cfg.num_kv_heads, -1)])
        fused[p + "o_proj"] = take("o_proj").contiguous()
        fused[p + "post_attn_norm"] = take("post_attn_norm").contiguous()
        if cfg.sandwich_norms:
            fused[p + "attn_out_norm"] = take("attn_out_norm").contiguous()
            fused[p + "mlp_out_norm"] = take("mlp_out_norm").contiguous()
        fused[p + "gate_up_proj"] = torch.cat([take("gate_proj"), take("up_proj")], dim=0)
        fused[p + "down_proj"] = take("down_proj").contiguous()
    return fused


def fuse_q4_blocks(cfg: ModelConfig, unfused: dict[str, Q4Blocks]) -> dict[str, Q4Blocks]:
    """The fused projections (as in fuse_weights) whose every part has 4-bit codes."""
    groups = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
              "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
    fused: dict[str, Q4Blocks] = {}
    for i in range(cfg.num_layers):
        for name, parts in groups.items():
            blocks = [unfused.get(f"layers.{i}.{p}") for p in parts]
            if all(b is not None for b in blocks):
                fused[f"layers.{i}.{name}"] = Q4Blocks.cat(blocks)
    return fused
