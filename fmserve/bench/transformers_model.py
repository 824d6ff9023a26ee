"""transformers' own model of a GGUF file, converted once and kept beside the model cache.

transformers reads a GGUF by parsing its whole vocabulary and dequantizing every tensor in
numpy: 20-100 s on 2 cores, paid on every `fmserve bench peers` run by its transformers
baselines and by the tests that use transformers as the independent reference. The first
reading is saved as its config and dense fp32 weights (safetensors, exact: transformers
itself dequantizes to fp32) under `<model cache>/hf-reference/`, keyed by the file's name,
size and mtime and transformers' version, so a changed file or another transformers converts
again; later loads read the saved weights (~2 s). The conversion parses the GGUF once, where
transformers alone parses it twice (Gemma 3 270M: 48.7 -> 30.9 s; SmolLM2-135M: 22.1 -> 15.7 s).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fmserve.model_cache import model_cache_dir

log = logging.getLogger(__name__)


def saved_dir(gguf: Path, what: str) -> Path:
    """Where transformers' reading of `gguf` (`what`: "model" or "tokenizer") is kept."""
    import transformers

    st = gguf.stat()
    key = f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-tf{transformers.__version__}"
    return model_cache_dir() / "hf-reference" / key / what


def save_into(write: Callable[[Path], None], target: Path) -> None:
    """`write` fills a temporary folder of this process's, renamed into place: a run stopped
    halfway leaves nothing that a later run would take for a complete copy, and two processes
    converting at once (two test workers) keep whichever copy is complete first."""
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    write(partial)
    try:
        partial.rename(target)
    except OSError:  # another process's copy is in place already
        shutil.rmtree(partial, ignore_errors=True)


def load_transformers(path: Path, dtype: torch.dtype = torch.float32,
                      attn_implementation: str | None = None):
    """transformers' causal LM of `path` (a model folder, or a GGUF file through its saved
    dense copy, made here the first time), in `dtype` and eval mode."""
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
    saved = saved_dir(path, "model")
    if not saved.is_dir():
        with one_gguf_parse():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32, **kw).eval()
        try:
            save_into(lambda folder: _save_weights(model, folder), saved)
        except OSError as exc:  # a full disk or a read-only cache: the next run converts again
            log.warning("could not keep transformers' reading of %s at %s (%s): the next "
                        "run reads the GGUF again", path.name, saved, exc)
        return model.to(dtype)  # the cast a saved copy's load makes
    return _load_saved(saved, dtype, kw)


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF's header twice to read a model (its config, then its
    weights), each time building every vocabulary entry as numpy views: ~20 s for Gemma 3's
    262,144 tokens on 2 cores. Within this block each file is parsed once: `gguf.GGUFReader`
    (which transformers imports when it reads) hands out one reader a file, read-only."""
    import gguf

    make = gguf.GGUFReader
    readers: dict[str, object] = {}

    def shared_reader(path, mode: str = "r"):
        if mode != "r":  # a writable map is not shared
            return make(path, mode)
        key = os.path.abspath(path)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = make


def _load_saved(saved: Path, dtype: torch.dtype, kw: dict):
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(saved)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kw)
    load_model(model, saved / "model.safetensors")  # fp32 weights, cast as transformers would
    return model.eval()


def _save_weights(model, folder: Path) -> None:
    """The config and the weights (tied ones once); the weights are dense, so the config
    loses its GGUF marker (transformers refuses save_pretrained on a model read from a GGUF)."""
    from safetensors.torch import save_model

    model.config.save_pretrained(folder)
    config = folder / "config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items()
                                  if k != "quantization_config"}, indent=2))
    save_model(model, str(folder / "model.safetensors"))
