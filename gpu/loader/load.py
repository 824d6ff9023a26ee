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
from gpu.loader.gguf_q4 import Int4Weight
from gpu.model_config import ModelConfig

ACCEPTED = (f"a .gguf file (architecture {' / '.join(SUPPORTED_GGUF)}), or a Hugging Face model "
            f"directory ({SUPPORTED_HF}) holding config.json and model.safetensors (or a "
            f"sharded model.safetensors.index.json)")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    source: Path
    # Fused projections whose every part the file stores in a type kept quantized (`keep_q4`
    # only): row segments of int4 weights (gpu/loader/gguf_q4.py). These have no entry in
    # `weights`: no dense copy is made.
    q4: dict[str, list[Int4Weight]] = field(default_factory=dict)
    # The lm_head (or the tied embedding) as an int4 weight when the file stores it in such a
    # type (`keep_q4` only). An untied one has no entry in `weights` then.
    lm_head_q4: Int4Weight | None = None


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               progress: bool = True, keep_q4: bool = False) -> LoadedModel:
    """Read a GGUF file or an HF directory; raises ModelLoadError with a readable message.
    `keep_q4`: keep a GGUF's quantized projections and lm_head as int4 weights
    (LoadedModel.q4, LoadedModel.lm_head_q4) instead of dequantizing them."""
    q4: dict[str, Int4Weight] = {}
    lm_head_q4: Int4Weight | None = None
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
    expected = _expected_shapes(config)
    for name, w in q4.items():
        shape = (w.shape.out_features, w.shape.in_features)
        if expected.get(name, shape) != shape:
            raise ModelLoadError(f"{source}: weight '{name}' has shape {shape}, but the model "
                                 f"config implies {expected[name]}; the file and its config "
                                 f"disagree")
    fused_q4 = fuse_q4_weights(config, q4, unfused, dtype)
    if lm_head_q4 is not None and not lm_head_q4.kernel_shape_ok():
        if "lm_head" not in unfused and not config.tie_word_embeddings:
            unfused["lm_head"] = lm_head_q4.dequantize().to(dtype)
        lm_head_q4 = None
    untied_head = {"lm_head"} if lm_head_q4 is not None and "lm_head" not in unfused else set()
    weights = fuse_weights(config, unfused, source, set(fused_q4) | untied_head)
    return LoadedModel(config=config, weights=weights, source=source, q4=fused_q4,
                       lm_head_q4=lm_head_q4)


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


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def fuse_weights(cfg: ModelConfig, unfused: dict[str, torch.Tensor],
                 source: Path, quantized: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Check every tensor's shape against the config, then fuse q/k/v and gate/up per layer.
    `quantized`: fused projections (and an lm_head) kept as int4 weights, absent here.

    Tensors are popped from `unfused` as they are fused, so peak memory stays near one copy.
    """
    expected = _expected_shapes(cfg)
    for name in quantized:
        if name == "lm_head":
            expected.pop(name, None)
            continue
        layer, fused_name = name.rsplit(".", 1)
        for part in _FUSED[fused_name]:
            expected.pop(f"{layer}.{part}")
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
        if p + "qkv_proj" not in quantized:
            fused[p + "qkv_proj"] = torch.cat([take("q_proj"), take("k_proj"), take("v_proj")])
        if cfg.qkv_bias:
            fused[p + "qkv_bias"] = torch.cat([take("q_bias"), take("k_bias"), take("v_bias")])
        if cfg.qk_norm:
            fused[p + "qk_norm"] = torch.cat([take("q_norm").expand(cfg.num_heads, -1),
                                              take("k_norm").expand(cfg.num_kv_heads, -1)])
        if p + "o_proj" not in quantized:
            fused[p + "o_proj"] = take("o_proj").contiguous()
        fused[p + "post_attn_norm"] = take("post_attn_norm").contiguous()
        if cfg.sandwich_norms:
            fused[p + "attn_out_norm"] = take("attn_out_norm").contiguous()
            fused[p + "mlp_out_norm"] = take("mlp_out_norm").contiguous()
        if p + "gate_up_proj" not in quantized:
            fused[p + "gate_up_proj"] = torch.cat([take("gate_proj"), take("up_proj")], dim=0)
        if p + "down_proj" not in quantized:
            fused[p + "down_proj"] = take("down_proj").contiguous()
    return fused


def fuse_q4_weights(cfg: ModelConfig, unfused_q4: dict[str, Int4Weight],
                    unfused: dict[str, torch.Tensor], dtype: torch.dtype
                    ) -> dict[str, list[Int4Weight]]:
    """The fused projections (as in fuse_weights) whose every part is an int4 weight the kernel
    can take, as row segments (parts that widen their input alike are concatenated). A part of
    any other projection is dequantized into `unfused`, to be fused densely."""
    fused: dict[str, list[Int4Weight]] = {}
    for i in range(cfg.num_layers):
        for name, parts in _FUSED.items():
            names = [f"layers.{i}.{p}" for p in parts]
            weights = [unfused_q4.pop(n, None) for n in names]
            segments: list[Int4Weight] = []
            for w in weights:
                if w is None or not w.kernel_shape_ok():
                    segments = []
                    break
                if segments and segments[-1].shape.width == w.shape.width and \
                        segments[-1].widening == w.widening:
                    segments[-1] = Int4Weight.cat([segments[-1], w])
                else:
                    segments.append(w)
            if segments:
                fused[f"layers.{i}.{name}"] = segments
                continue
            for n, w in zip(names, weights):
                if w is not None:
                    unfused[n] = w.dequantize().to(dtype)
    return fused
