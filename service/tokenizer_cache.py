"""A GGUF's built tokenizer kept on disk, so that a later start reads it instead of building it.

Building the `tokenizers` backend from a GGUF's vocabulary is Python work over every token:
Gemma 3's 262,144 SentencePiece tokens took ~4.9 s on one core (their BPE merges are derived
from the token order, service/gguf_tokenizer.py), and the service and each worker-side engine
built it at every start. The built tokenizer's JSON is kept in the fmserve cache dir, named by
the file (path, size, modification time), the code that builds it and the `tokenizers`
version; reading it back took ~1.7 s (its 0.5 M merges), 2.0 s with the file's metadata
against 5.1 s. An unreadable entry is built again and replaced. Only
vocabularies of MIN_TOKENS and more are kept: a 49,152-token one builds in ~0.3 s, and the
GGUFs tests write would each leave an entry behind. An entry is ~14 MB for Gemma 3; those of
an older file or builder stay until the cache dir is cleared.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer

from ipc.cache_dirs import model_cache_dir

log = logging.getLogger(__name__)

_BUILDER = Path(__file__).with_name("gguf_tokenizer.py")  # a change to it invalidates entries
MIN_TOKENS = 100_000


def cache_path(path: Path) -> Path:
    """Where the tokenizer of the GGUF at `path` is kept (as it is now on disk)."""
    st = path.stat()
    key = hashlib.sha256("\0".join([
        str(path.resolve()), str(st.st_size), str(st.st_mtime_ns), tokenizers.__version__,
        hashlib.sha256(_BUILDER.read_bytes()).hexdigest()]).encode()).hexdigest()[:24]
    return model_cache_dir() / "tokenizers" / f"{key}.json"


def cached_tokenizer(path: Path, num_tokens: int, build: Callable[[], Tokenizer]) -> Tokenizer:
    """The kept tokenizer of the GGUF at `path` (of `num_tokens` tokens), else `build()`'s,
    kept for next time where the vocabulary is large."""
    if num_tokens < MIN_TOKENS:
        return build()
    entry = cache_path(path)
    if entry.exists():
        try:
            return Tokenizer.from_file(str(entry))
        except Exception as exc:  # noqa: BLE001 - truncated or foreign: build it again
            log.warning("the kept tokenizer %s could not be read (%s); building it again",
                        entry, exc)
    tokenizer = build()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the entry and renamed: a reader never sees half a file.
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, suffix=".tmp",
                                         delete=False) as tmp:
            tmp.write(tokenizer.to_str())
        os.replace(tmp.name, entry)
    except OSError as exc:  # a read-only cache: the next start builds it again
        log.info("could not keep the tokenizer of %s in %s: %s", path, entry.parent, exc)
    return tokenizer
