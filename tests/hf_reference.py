"""transformers' own reading of a GGUF file, the independent reference the model, loader and
tokenizer tests compare against. Converting a GGUF takes transformers 20-100 s, so each
conversion is made once and saved beside the model cache (fmserve/bench/transformers_model.py,
which `fmserve bench peers` shares): a later run, or the bench, loads the saved output. Each is
also kept in memory for the test run (shared by every module that asks)."""

from __future__ import annotations

import functools
from pathlib import Path

from fmserve.bench.transformers_model import (load_transformers, one_gguf_parse, save_into,
                                              saved_dir)


@functools.cache
def hf_tokenizer(gguf: Path):
    """transformers' tokenizer of `gguf` (AutoTokenizer with gguf_file)."""
    from transformers import AutoTokenizer

    saved = saved_dir(gguf, "tokenizer")
    if saved.is_dir():
        return AutoTokenizer.from_pretrained(saved)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    save_into(tok.save_pretrained, saved)
    return tok


@functools.cache
def hf_causal_lm(gguf: Path, attn_implementation: str | None = None):
    """transformers' fp32 model of `gguf` (AutoModelForCausalLM with gguf_file), in eval mode.
    Shared: callers must not change it."""
    return load_transformers(gguf, attn_implementation=attn_implementation)


def hf_tokenizer_and_causal_lm(gguf: Path, attn_implementation: str | None = None):
    """Both, where not saved yet converted from one parse of the file: transformers parses a
    GGUF for each (Gemma 3's 262,144-token vocabulary: ~20 s a parse on 2 cores)."""
    with one_gguf_parse():
        return hf_tokenizer(gguf), hf_causal_lm(gguf, attn_implementation)
