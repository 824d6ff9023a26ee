"""Model loaders against independent references.

- The real GGUF: our dequantized, un-permuted, fused weights vs transformers' GGUF state dict.
- Tiny synthetic files: HF directories written by transformers' `save_pretrained`, and GGUF files
  written with `gguf.GGUFWriter` after applying llama.cpp's own q/k row permutation.
- Every failure a person can cause raises ModelLoadError naming the offending file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gpu.loader.errors import ModelLoadError
from gpu.loader.load import load_model
from gpu.loader.hf_loader import hf_model_config
from gpu.model_config import RopeScaling
from tests.hf_reference import hf_causal_lm

@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(gguf_path, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def reference(gguf_path):
    model = hf_causal_lm(gguf_path)
    return model.config, {k: v.detach() for k, v in model.state_dict().items()}


def _unfuse(cfg, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our fused layout back to HF names, by slicing (the reference has no fused tensors)."""
    out = {"model.embed_tokens.weight": weights["embed_tokens"],
           "model.norm.weight": weights["final_norm"]}
    if "lm_head" in weights:
        out["lm_head.weight"] = weights["lm_head"]
    for i in range(cfg.num_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = weights[p + "qkv_proj"].split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate, up = weights[p + "gate_up_proj"].split([cfg.intermediate_size] * 2)
        out.update({
            hf + "self_attn.q_proj.weight": q, hf + "self_attn.k_proj.weight": k,
            hf + "self_attn.v_proj.weight": v,
            hf + "self_attn.o_proj.weight": weights[p + "o_proj"],
            hf + "mlp.gate_proj.weight": gate, hf + "mlp.up_proj.weight": up,
            hf + "mlp.down_proj.weight": weights[p + "down_proj"],
            hf + "input_layernorm.weight": weights[p + "input_norm"],
            hf + "post_attention_layernorm.weight": weights[p + "post_attn_norm"],
        })
    return out


# -- the real GGUF vs transformers -----------------------------------------------------------

def test_gguf_weights_match_transformers(ours, reference):
    _, ref = reference
    unfused = _unfuse(ours.config, ours.weights)
    ref_names = {k for k in ref if k != "lm_head.weight"}  # tied: transformers aliases embeddings
    assert set(unfused) == ref_names
    for name, tensor in unfused.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)


def test_gguf_layout_and_config_match_transformers(ours, reference):
    ref_cfg, _ = reference
    cfg = ours.config
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        ref_cfg.num_hidden_layers, ref_cfg.hidden_size, ref_cfg.intermediate_size)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        ref_cfg.num_attention_heads, ref_cfg.num_key_value_heads, ref_cfg.head_dim,
        ref_cfg.vocab_size)
    assert cfg.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps)
    assert cfg.rope_theta == pytest.approx(ref_cfg.rope_parameters["rope_theta"])
    assert cfg.max_context_len == ref_cfg.max_position_embeddings
    assert cfg.tie_word_embeddings == ref_cfg.tie_word_embeddings
    assert cfg.rope_scaling is None
    assert cfg.bos_token_id == ref_cfg.bos_token_id
    assert ref_cfg.eos_token_id in cfg.eos_token_ids
    assert ("lm_head" in ours.weights) == (not cfg.tie_word_embeddings)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in ours.weights.values())
    assert ours.weights["layers.0.qkv_proj"].shape == (cfg.q_size + 2 * cfg.kv_size,
                                                       cfg.hidden_size)
    assert ours.weights["layers.0.gate_up_proj"].shape == (2 * cfg.intermediate_size,
                                                          cfg.hidden_size)


# -- HF directories written by transformers ---------------------------------------------------

def _tiny_llama(tmp_path: Path, tie: bool, rope: dict | None,
                shard: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1,
                         eos_token_id=[2, 5], rope_parameters=rope)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at exactly 1; make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "1GB")
    return model


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize("tie, rope, shard", [(False, LLAMA3_ROPE, False),
                                              (True, None, True)])
def test_hf_directory_round_trip(tmp_path, tie, rope, shard):
    model = _tiny_llama(tmp_path, tie, rope, shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard
    loaded = load_model(tmp_path, dtype=torch.float32, progress=False)
    cfg, hf = loaded.config, model.config
    assert loaded.source == tmp_path
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.max_context_len) == (
        hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.num_attention_heads,
        hf.num_key_value_heads, hf.head_dim, hf.vocab_size, hf.max_position_embeddings)
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg.tie_word_embeddings == tie
    assert cfg.bos_token_id == 1 and set(cfg.eos_token_ids) == {2, 5}
    if rope is None:
        assert cfg.rope_scaling is None
    else:
        assert cfg.rope_scaling == RopeScaling(rope["factor"], rope["low_freq_factor"],
                                               rope["high_freq_factor"],
                                               rope["original_max_position_embeddings"])
    ref = model.state_dict()
    unfused = _unfuse(cfg, loaded.weights)
    assert ("lm_head.weight" in unfused) == (not tie)
    for name, tensor in unfused.items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)


def test_hf_directory_casts_every_tensor(tmp_path):
    _tiny_llama(tmp_path, tie=False, rope=None)
    loaded = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    assert {t.dtype for t in loaded.weights.values()} == {torch.bfloat16}


# -- GGUF files written with llama.cpp's conventions -------------------------------------------

def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama3_rope_freqs(s: dict, head_dim: int, base: float) -> np.ndarray:
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


def _write_gguf(path: Path, model: LlamaForCausalLM | None, arch: str = "llama",
                storage: dict[str, gguf.GGMLQuantizationType] | None = None,
                rope_freqs: np.ndarray | None = None) -> None:
    """A GGUF as llama.cpp's converter would write `model` (F32 unless `storage` says otherwise)."""
    cfg = model.config if model is not None else LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    tensors: dict[str, np.ndarray] = {}
    if model is not None:
        sd = {k: v.numpy() for k, v in model.state_dict().items()}
        tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
                   "output_norm.weight": sd["model.norm.weight"]}
        if not cfg.tie_word_embeddings:
            tensors["output.weight"] = sd["lm_head.weight"]
        names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
        for i in range(cfg.num_hidden_layers):
            for ggml, hf in names.items():
                w = sd[f"model.layers.{i}.{hf}.weight"]
                if ggml == "attn_q":
                    w = _llama_cpp_permute(w, cfg.num_attention_heads)
                elif ggml == "attn_k":
                    w = _llama_cpp_permute(w, cfg.num_key_value_heads)
                tensors[f"blk.{i}.{ggml}.weight"] = w
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs
    for name, w in tensors.items():
        kind = (storage or {}).get(name, gguf.GGMLQuantizationType.F32)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        elif kind == gguf.GGMLQuantizationType.Q8_1:  # bytes only: gguf cannot dequantize it
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            blocks = np.zeros((w.shape[0], w.shape[1] // block_elems * block_bytes), np.uint8)
            writer.add_tensor(name, blocks, raw_dtype=kind)
        else:
            # raw_dtype: the writer turns the byte shape back into the element shape
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), kind),
                              raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_synthetic_gguf_undoes_llama_cpp_layout(tmp_path):
    """GQA q/k un-permutation, F16/BF16 storage and Llama-3 rope_freqs, without transformers."""
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    model = _tiny_llama(tmp_path / "hf", tie=False, rope={"rope_type": "default",
                                                         "rope_theta": 500000.0})
    T = gguf.GGMLQuantizationType
    storage = {"blk.0.attn_q.weight": T.F16, "blk.1.attn_k.weight": T.BF16,
               "output.weight": T.BF16}
    file = tmp_path / "tiny.gguf"
    _write_gguf(file, model, storage=storage,
                rope_freqs=_llama3_rope_freqs(rope, model.config.head_dim, 500000.0))
    loaded = load_model(file, progress=False)
    assert loaded.config.rope_scaling == RopeScaling(**rope)
    assert loaded.config.num_kv_heads == 2 and not loaded.config.tie_word_embeddings
    ref = model.state_dict()
    for name, tensor in _unfuse(loaded.config, loaded.weights).items():
        expected = ref[name]
        if "layers.0.self_attn.q_proj" in name:
            expected = expected.half().float()
        elif "layers.1.self_attn.k_proj" in name or name == "lm_head.weight":
            expected = expected.bfloat16().float()
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)


# -- errors a person can cause --------------------------------------------------------------

def test_missing_path(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(ModelLoadError, match="no-such-model.gguf"):
        load_model(missing)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json") as e:
        load_model(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_truncated_gguf(tmp_path, gguf_path):
    truncated = tmp_path / "truncated-copy.gguf"
    with open(gguf_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated-copy.gguf") as e:
        load_model(truncated, progress=False)
    assert "download" in str(e.value)


def test_gguf_with_other_architecture(tmp_path):
    file = tmp_path / "tiny-phi.gguf"
    _write_gguf(file, None, arch="phi3")
    with pytest.raises(ModelLoadError, match=r"architecture 'phi3' in .*tiny-phi.gguf.*"
                                             r"supported: llama, qwen2, qwen3, gemma3"):
        load_model(file, progress=False)


def test_gguf_with_undecodable_quant_type(tmp_path):
    model = _tiny_llama(tmp_path / "hf", tie=True, rope=None)
    file = tmp_path / "odd-quant.gguf"
    _write_gguf(file, model, storage={"blk.1.ffn_up.weight": gguf.GGMLQuantizationType.Q8_1})
    with pytest.raises(ModelLoadError, match=r"odd-quant.gguf.*blk.1.ffn_up.weight.*Q8_1"):
        load_model(file, progress=False)


def test_hf_config_of_other_model_type(tmp_path):
    _tiny_llama(tmp_path, tie=True, rope=None)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError,
                       match=r"config.json.*'gpt2'.*supported: llama .*mistral.*gemma3_text"):
        load_model(tmp_path, progress=False)


def test_hf_directory_missing_weights_or_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    _tiny_llama(tmp_path, tie=True, rope=None)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path, progress=False)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model.safetensors"):
        load_model(tmp_path, progress=False)


def test_not_a_model_file(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"weights.bin.*\.gguf"):
        load_model(file)


def test_cli_reports_a_load_error_without_a_traceback(tmp_path, capsys):
    # ModelLoadError is no ValueError, so `fmserve generate` (and bench offline, train-eagle)
    # printed the whole traceback of a model directory without weights.
    from tokenizers import Tokenizer, models, pre_tokenizers

    from fmserve.cli import main

    _tiny_llama(tmp_path, tie=True, rope=None)
    (tmp_path / "model.safetensors").unlink()
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert main(["generate", "--raw", "--prompt", "w3 w4", "--model", str(tmp_path),
                 "--device", "cpu", "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "fmserve: error: " in err and "model.safetensors" in err
    assert "Traceback" not in err


# ----- config.json values of the wrong type -----
# Wrongly typed input is refused up front, in words: a Hugging Face config.json value of the
# wrong type names the file (and the key, where one is at fault), with no traceback from deep in
# the loader.

GOOD = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 96,
        "eos_token_id": 2}


def test_a_good_config_loads(tmp_path):
    cfg = hf_model_config(GOOD, tmp_path / "config.json")
    assert (cfg.hidden_size, cfg.num_layers, cfg.eos_token_ids) == (64, 2, (2,))


@pytest.mark.parametrize("change, needle", [
    ({"quantization_config": "x"}, "'quantization_config' is 'x'"),
    ({"rope_parameters": "x"}, "'rope_parameters' is 'x'"),
    ({"rope_scaling": [1, 2]}, "'rope_scaling' is [1, 2]"),
    ({"hidden_size": "abc"}, "'hidden_size' is the string 'abc'"),
    ({"eos_token_id": "x"}, "wrong type or form"),
    ({"rms_norm_eps": {"a": 1}}, "wrong type or form"),
])
def test_wrong_types_name_the_file(tmp_path, change, needle):
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(GOOD | change))
    with pytest.raises(ModelLoadError) as info:
        hf_model_config(GOOD | change, config_file)
    assert str(config_file) in str(info.value) and needle in str(info.value)
