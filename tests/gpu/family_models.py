"""Tiny random-weight models of every family we run, written as transformers writes them
(config.json + safetensors) and as llama.cpp's converter would (GGUF), with a 320-token
byte-level BPE tokenizer in both. The reference is transformers itself, on the same weights
as stored (F16 or Q8_0 values dequantized), with a plain greedy loop (no KV cache).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

VOCAB = 320
BOS, EOS = VOCAB - 2, VOCAB - 1
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.2)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64}
# family -> (transformers config class, its settings, GGUF architecture)
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
              "llama"),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=8, tie_word_embeddings=False),
                "llama"),
    "qwen2": ("Qwen2Config", dict(rope_parameters=YARN_ROPE, tie_word_embeddings=True), "qwen2"),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True), "qwen3"),
    # Six layers: llama.cpp's fixed pattern (and transformers' default) makes the last global
    # and the others windowed; local layers rotate with their own base.
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, num_hidden_layers=6, sliding_window=8,
                                        query_pre_attn_scalar=16, rope_theta=10000.0,
                                        rope_local_base_freq=100.0, tie_word_embeddings=True),
               "gemma3"),
}
# HF per-layer tensor name -> GGUF's (llama.cpp's tensor names)
_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias",
               "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}
# Gemma's four norms (llama.cpp's ffn_norm is the one before the MLP, as for Llama).
_GGUF_GEMMA_NORMS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def tiny_vocab() -> tuple[list[str], list[str]]:
    """GPT-2 byte-alphabet tokens, 62 two-letter merges, then <s> and </s>."""
    from service.tokenizer import _byte_alphabet

    alphabet = _byte_alphabet()
    tokens = [alphabet[b] for b in range(256)]
    letters = "etaoinshrdlu"
    merges = [f"{a} {b}" for a in letters for b in letters][:VOCAB - 258]
    return tokens + [m.replace(" ", "") for m in merges] + ["<s>", "</s>"], merges


def hf_config(family: str, **changes) -> transformers.PretrainedConfig:
    cls, settings, _ = FAMILIES[family]
    return getattr(transformers, cls)(**(COMMON | settings | changes))


def random_model(family: str, **changes) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **changes),
                                                          attn_implementation="eager")
    # Norms start at exactly 1 (Gemma's at 0, it scales by 1 + w) and biases at 0: make them
    # count.
    low = -0.5 if family == "gemma3" else 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(low, low + 1)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    return model.eval()


def save_hf_dir(model: transformers.PreTrainedModel, path: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model.save_pretrained(path)
    tokens, merges = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens[:-2])},
                               merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in tokens[-2:]])
    tok.save(str(path / "tokenizer.json"))
    return path


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freqs(s: dict, head_dim: int, base: float) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for rope_type llama3."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
                      / (s["high_freq_factor"] - s["low_freq_factor"]))
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def stored(w: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """A matrix as `kind` holds it, dequantized (1-D tensors stay F32, as llama.cpp keeps them)."""
    if w.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), kind), kind)


def write_gguf(model: transformers.PreTrainedModel, family: str, path: Path,
               kind: gguf.GGMLQuantizationType) -> Path:
    """`model` as llama.cpp's converter writes it: matrices in `kind`, vectors in F32."""
    cfg = model.config
    arch = FAMILIES[family][2]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None) and family in ("mistral", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
    if family == "gemma3":
        writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tokens, merges = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
               "output_norm.weight": sd["model.norm.weight"] + (arch == "gemma3")}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(rope, head_dim, rope["rope_theta"])
    for name, w in sd.items():
        prefix, _, rest = name.partition(".layers.")
        if not rest:
            continue
        i, hf = rest.split(".", 1)
        if arch == "llama" and hf == "self_attn.q_proj.weight":
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and hf == "self_attn.k_proj.weight":
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if arch == "gemma3" and "norm" in hf:
            w = w + 1  # llama.cpp's Gemma converter stores 1 + w
        layer_names = _GGUF_LAYER | (_GGUF_GEMMA_NORMS if arch == "gemma3" else {})
        tensors[f"blk.{i}.{layer_names[hf]}"] = w
    for name, w in tensors.items():
        if w.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), kind),
                              raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def as_stored(model: transformers.PreTrainedModel,
              kind: gguf.GGMLQuantizationType) -> transformers.PreTrainedModel:
    """A copy of `model` whose weights are the values a `kind` GGUF holds."""
    ref = copy.deepcopy(model)
    state = {k: torch.from_numpy(stored(v.detach().numpy(), kind))
             for k, v in ref.state_dict().items()}
    ref.load_state_dict(state)
    return ref


def reference_greedy(model: transformers.PreTrainedModel, prompt: list[int],
                     n: int) -> list[int]:
    """n greedy tokens, each from a full forward over everything so far."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
