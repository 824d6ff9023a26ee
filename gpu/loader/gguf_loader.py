"""GGUF (llama.cpp) files: metadata -> ModelConfig, tensors -> dequantized, un-permuted HF layout.

Two llama.cpp conventions are undone here:
- GGUF lists a tensor's dims innermost first; numpy (and we) list them outermost first, so a
  weight stored as dims `[in, out]` is the HF `[out, in]` matrix.
- llama.cpp's converter permutes the rows of q and k of "llama" files (Llama, Mistral) so that
  its rope can rotate adjacent pairs (GPT-J style). The runtime uses rotate-half rope (HF
  style), so the permutation is inverted. Its Qwen2/Qwen3/Gemma 3 converters leave q and k as
  they are.
- Its Gemma converter stores every RMSNorm weight as 1 + w (llama.cpp scales by the weight
  alone); the model adds the 1 itself (config.norm_adds_one), so 1 is taken off here, as
  transformers' GGUF loader does.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from gpu.loader.errors import ModelLoadError
from gpu.loader.families import DEFAULT_LOCAL_ROPE_THETA, gguf_family, pattern_window_layers
from gpu.loader.fp32_convert import blocks_to_fp32
from gpu.loader.gguf_kquants import is_kquant, kquant_weight
from gpu.loader.gguf_q4 import (Int4Weight, dequantize_blocks_fp32, is_q4, is_q5, q4_blocks,
                                q5_as_q4_pair, q8_0_as_q4_pair)
from gpu.model_config import ModelConfig
from gpu.rope_scaling import ROPE_SCALING_KINDS, RopeScaling, rope_inv_freq
from ipc.gguf_file import GGUFFile

# GGUF per-block tensor name (without "blk.{i}.") -> our unfused name (load.py: fused layout).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_attn_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "attn_out_norm",  # Gemma's norms on the attention and MLP
    "post_ffw_norm.weight": "mlp_out_norm",  # outputs (its ffn_norm is the one before the MLP)
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "embed_tokens",
    "output_norm.weight": "final_norm",
    "output.weight": "lm_head",
}
# Llama 3.1+ files carry rope scaling as precomputed per-frequency factors, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"

_REQUIRED = object()


def open_gguf(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as e:  # GGUFFormatError (truncated, corrupt, big-endian), OSError
        reason = str(e).rstrip(".")
        raise ModelLoadError(
            f"could not read GGUF file {path}: {reason}. The file looks truncated or corrupt "
            f"(an interrupted download?); download it again.") from e


def gguf_value(reader: GGUFFile, key: str, path: Path, default=_REQUIRED):
    """One metadata value as a Python scalar, string or list."""
    if key not in reader.fields:
        if default is _REQUIRED:
            raise ModelLoadError(f"GGUF file {path} lacks the metadata key '{key}'; it was not "
                                 f"written by a llama.cpp converter we understand")
        return default
    return reader.fields[key]


def gguf_model_config(reader, path: Path) -> ModelConfig:
    arch = gguf_value(reader, "general.architecture", path)
    family = gguf_family(arch, path)

    def meta(key: str, default=_REQUIRED):
        return gguf_value(reader, f"{arch}.{key}", path, default)

    if int(meta("expert_count", 0) or 0) > 0:
        raise ModelLoadError(f"{path} is a mixture-of-experts model ({arch}.expert_count > 0); "
                             f"only dense models are supported")
    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    rope_dims = int(meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"{path}: rope covers {rope_dims} of {head_dim} head dims; partial "
                             f"rotary embeddings are not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size", None)
    if vocab is None:
        if tokens is None:
            raise ModelLoadError(f"{path} states neither {arch}.vocab_size nor a token list")
        vocab = len(tokens)
    rope_theta = float(meta("rope.freq_base", 10000.0))
    eos = gguf_value(reader, "tokenizer.ggml.eos_token_id", path, None)
    eot = gguf_value(reader, "tokenizer.ggml.eot_token_id", path, None)
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    bos = gguf_value(reader, "tokenizer.ggml.bos_token_id", path, None)
    tensor_names = {t.name for t in reader.tensors}
    num_layers = int(meta("block_count"))
    window = meta("attention.sliding_window", None)
    window_layers = None
    if window is not None and family.window_pattern is not None:
        # llama.cpp's Gemma 3 has a fixed pattern of 6 where the file states none; newer files
        # may state it as a number or as a flag per layer.
        pattern = meta("attention.sliding_window_pattern", family.window_pattern)
        window_layers = (tuple(i for i, swa in enumerate(pattern) if swa)
                         if isinstance(pattern, list)
                         else pattern_window_layers(int(pattern), num_layers))
    if meta("attn_logit_softcapping", None) is not None:
        raise ModelLoadError(f"{path}: attention logit softcapping (Gemma 2's) is not supported")
    softcap = meta("final_logit_softcapping", None)
    return ModelConfig(
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=int(vocab),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        max_context_len=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        rope_scaling=_rope_scaling(reader, arch, path, head_dim, rope_theta),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        sliding_window=None if window is None else int(window),
        window_layers=window_layers or None,
        local_rope_theta=(float(meta("rope.freq_base_swa", DEFAULT_LOCAL_ROPE_THETA))
                          if family.local_rope else None),
        query_pre_attn_scalar=_query_pre_attn_scalar(arch, num_layers, hidden, num_heads),
        final_logit_softcap=None if softcap is None else float(softcap),
        **family.config_flags(),
    )


def _query_pre_attn_scalar(arch: str, num_layers: int, hidden: int, num_heads: int
                           ) -> float | None:
    """What llama.cpp scales Gemma 3's scores by (its files do not say): 1/sqrt(hidden / heads)
    for the 27B (62 layers), 1/sqrt(head_dim) for the others, as their configs state."""
    if arch == "gemma3" and num_layers == 62:
        return hidden / num_heads
    return None


def _rope_scaling(reader, arch: str, path: Path, head_dim: int, theta: float) -> RopeScaling | None:
    def meta(key: str, default=None):
        return gguf_value(reader, f"{arch}.rope.scaling.{key}", path, default)

    kind = meta("type")
    if kind in ("linear", "yarn"):
        original = meta("original_context_length", None)
        return RopeScaling(factor=float(meta("factor")), kind=kind,
                           original_max_position_embeddings=int(
                               original or gguf_value(reader, f"{arch}.context_length", path)),
                           beta_fast=float(meta("yarn_beta_fast", 32.0)),
                           beta_slow=float(meta("yarn_beta_slow", 1.0)))
    if kind not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling type '{kind}' is not supported; supported: "
                             f"{', '.join(ROPE_SCALING_KINDS)}")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is None:
        return None
    factors = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
    # The file keeps only the per-frequency divisors of Llama-3 scaling. Recover the parameters
    # by recomputing them for the published Llama 3.x settings and checking they match.
    factor = float(factors.max())
    candidate = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
    expected = (rope_inv_freq(head_dim, theta, None)
                / rope_inv_freq(head_dim, theta, candidate)).double().numpy()
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4, atol=1e-5):
        raise ModelLoadError(f"{path}: tensor {_ROPE_FREQS} holds rope factors that do not match "
                             f"Llama-3 scaling (factor {factor}, low 1, high 4, original context "
                             f"8192); this rope scaling is not supported")
    return candidate


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's `w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _our_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _dequantize(tensor, path: Path) -> torch.Tensor:
    from gguf.quants import dequantize

    shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF dims are innermost first
    try:
        if len(shape) == 2:
            name = tensor.tensor_type.name
            fast = blocks_to_fp32(tensor.data, name, *shape)  # in C, else in torch
            if fast is None:
                fast = dequantize_blocks_fp32(tensor.data, name, *shape)
            if fast is not None:
                return fast
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(f"{path}: tensor '{tensor.name}' is stored as "
                             f"{tensor.tensor_type.name}, which the gguf package cannot "
                             f"dequantize; use a file quantized as F32, F16, BF16, Q8_0, Q4_0, "
                             f"Q4_1, Q4_K, Q5_K or Q6_K") from e
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor '{tensor.name}' could not be decoded ({e}); the file "
                             f"looks corrupt, download it again") from e
    if values.size != math.prod(shape):
        raise ModelLoadError(f"{path}: tensor '{tensor.name}' decoded to {values.size} values, "
                             f"expected {math.prod(shape)}; the file looks corrupt, download it "
                             f"again")
    values = values.reshape(shape)
    if not values.flags.writeable:  # a view of the read-only file map: copy, never alias it
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False))


def int4_weight(tensor, rows: int, cols: int) -> Int4Weight | None:
    """A Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/K-quant tensor as an Int4Weight (no dense copy); None for other types."""
    type_name = tensor.tensor_type.name
    if is_q4(type_name):
        return Int4Weight.from_parts([q4_blocks(tensor.data, type_name, rows, cols)])
    if type_name == "Q8_0":
        return Int4Weight.from_parts(q8_0_as_q4_pair(tensor.data, rows, cols))
    if is_q5(type_name):
        return Int4Weight.from_parts(q5_as_q4_pair(tensor.data, type_name, rows, cols))
    if is_kquant(type_name):
        return kquant_weight(tensor.data, type_name, rows, cols)
    return None


def load_gguf(path: Path, dtype: torch.dtype, progress: bool = True, keep_q4: bool = False
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Int4Weight],
                         Int4Weight | None]:
    """ModelConfig, unfused tensors (our short names, HF [out, in] layout, `dtype`, CPU) and,
    with `keep_q4`, the layer projections stored as Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K as
    Int4Weights (same names and row order) *instead of* dense tensors, and the lm_head's (the
    embedding's when the model ties them; the dense embedding stays, the lookup reads it)."""
    reader = open_gguf(path)
    config = gguf_model_config(reader, path)
    arch = config.architecture
    permuted = gguf_family(arch, path).gguf_qk_permuted
    weights: dict[str, torch.Tensor] = {}
    q4: dict[str, Int4Weight] = {}
    head: dict[str, Int4Weight] = {}  # embed_tokens / lm_head
    tensors = tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor", disable=not progress)
    for tensor in tensors:
        if tensor.name == _ROPE_FREQS:
            continue  # consumed by gguf_model_config
        name = _our_name(tensor.name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor '{tensor.name}' is not part of a {arch} model "
                                 f"we can run (extra heads and the like are not supported)")
        shape = tuple(reversed([int(d) for d in tensor.shape]))  # GGUF dims are innermost first
        quantized = int4_weight(tensor, *shape) if keep_q4 and len(shape) == 2 else None
        heads = None
        if permuted and (name.endswith(".q_proj") or name.endswith(".k_proj")):
            heads = config.num_heads if name.endswith(".q_proj") else config.num_kv_heads
        if quantized is not None and name.startswith("layers."):
            if heads is not None:
                quantized = quantized.map_rows(lambda t: unpermute_rope_rows(t, heads).contiguous())
            q4[name] = quantized
            continue  # no dense copy
        if quantized is not None:
            head[name] = quantized
            if name == "lm_head":
                continue  # the embedding is looked up; an untied lm_head only multiplies
        w = _dequantize(tensor, path)
        if heads is not None:
            w = unpermute_rope_rows(w, heads)
        if config.norm_adds_one and name.endswith("norm"):
            w = w - 1  # the converter's 1 + w back to w
        weights[name] = w.to(dtype).contiguous()
    untied = "lm_head" in weights or "lm_head" in head
    return config, weights, q4, head.get("lm_head" if untied else "embed_tokens")
