"""A tiny random Llama GGUF whose projections are K-quants, as a Q4_K_M file mixes them.

The gguf package cannot quantize to K-quants, so the tensors are raw super-blocks of random
bytes with finite, moderate fp16 scales written in (the layouts are in
gpu/loader/gguf_kquants.py); gguf's `dequantize` reads them back as the reference.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 320
# As llama.cpp's Q4_K_M: Q4_K for most, Q6_K for attn_v and the output; ffn_down as Q5_K here
# so every K-quant is covered.
STORAGE = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
           "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q5_K}
# (GGUF dims are innermost first, so a [out, in] matrix is written as in, out.)
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HIDDEN // HEADS, HIDDEN),
          "attn_v": (KV_HEADS * HIDDEN // HEADS, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
          "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
          "ffn_down": (HIDDEN, INTERMEDIATE)}
# Byte offsets of the fp16 scales in each super-block, and their magnitude: weights of a few
# hundredths, as a trained model's.
_FP16_SCALES = {T.Q4_K: ((0, 2e-4), (2, 2e-4)), T.Q5_K: ((0, 1e-4), (2, 1e-4)),
                T.Q6_K: ((208, 1e-4),), T.Q5_0: ((0, 1e-3),), T.Q5_1: ((0, 1e-3), (2, 1e-2)),
                T.Q8_0: ((0, 1e-3),)}


def random_blocks(kind: gguf.GGMLQuantizationType, rows: int, cols: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `kind`'s layout, [rows, bytes per row], with sane fp16 scales."""
    elems, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // elems, size), dtype=np.uint8)
    for offset, magnitude in _FP16_SCALES[kind]:
        d = rng.uniform(0.25, 1.0, raw.shape[:2]) * magnitude
        raw[..., offset:offset + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_kquant_llama(path: Path, seed: int = 0, output: gguf.GGMLQuantizationType = T.Q6_K
                       ) -> Path:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN), np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    writer.add_tensor("output.weight", random_blocks(output, VOCAB, HIDDEN, rng),
                      raw_dtype=output)
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight",
                              rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        for name, kind in STORAGE.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", random_blocks(kind, *SHAPES[name], rng),
                              raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
