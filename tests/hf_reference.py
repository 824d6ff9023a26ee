"""transformers' own reading of a GGUF file, the independent reference the model, loader and
tokenizer tests compare against. Converting a GGUF takes transformers 20-100 s (its gguf reader
parses the whole vocabulary and dequantizes every tensor in numpy), so each conversion is made
once per test run (shared by every module that asks) and saved beside the model cache
(`<model cache>/hf-reference/`, keyed by the file's name, size and mtime and transformers'
version): a later run loads transformers' saved output instead of converting again."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from fmserve.model_cache import model_cache_dir


def _saved_dir(gguf: Path, what: str) -> Path:
    import transformers

    st = gguf.stat()
    key = f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-tf{transformers.__version__}"
    return model_cache_dir() / "hf-reference" / key / what


def _save(write: Callable[[Path], None], target: Path) -> None:
    """`write` fills a temporary folder renamed into place: a run stopped halfway leaves
    nothing that a later run would take for a complete reference."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


@functools.cache
def hf_tokenizer(gguf: Path):
    """transformers' tokenizer of `gguf` (AutoTokenizer with gguf_file)."""
    from transformers import AutoTokenizer

    saved = _saved_dir(gguf, "tokenizer")
    if saved.is_dir():
        return AutoTokenizer.from_pretrained(saved)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _save(tok.save_pretrained, saved)
    return tok


@functools.cache
def hf_causal_lm(gguf: Path, attn_implementation: str | None = None):
    """transformers' fp32 model of `gguf` (AutoModelForCausalLM with gguf_file), in eval mode.
    Shared: callers must not change it. Saved as its config and its weights (safetensors,
    exact): transformers refuses save_pretrained on a model it read from a GGUF."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    saved = _saved_dir(gguf, "model")
    if saved.is_dir():
        config = AutoConfig.from_pretrained(saved)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kw)
        load_model(model, saved / "model.safetensors")
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32, **kw).eval()
    _save(lambda folder: _save_weights(model, folder), saved)
    return model


def _save_weights(model, folder: Path) -> None:
    """The config and the weights (tied ones once); the weights are dense, so the config
    loses its GGUF marker."""
    from safetensors.torch import save_model

    model.config.save_pretrained(folder)
    config = folder / "config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items()
                                  if k != "quantization_config"}, indent=2))
    save_model(model, str(folder / "model.safetensors"))
