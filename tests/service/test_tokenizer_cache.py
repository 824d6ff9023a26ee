"""service/tokenizer_cache.py: a GGUF's built tokenizer kept on disk and read back at the next
start, the same tokenizer; a changed file or an unreadable entry builds it again."""

from __future__ import annotations

import os
import shutil

import pytest

from service import tokenizer_cache
from service.gguf_tokenizer import build_gguf_tokenizer, gguf_tokenizer_metadata
from service.tokenizer_cache import cache_path, cached_tokenizer

TEXTS = ["Hello   world, the  quick brown fox", "<|im_start|>user\nÀ bientôt! 🙂<|im_end|>",
         "def f(x):\n\treturn x ** 2  # ok"]


@pytest.fixture
def gguf(gguf_path, tmp_path, monkeypatch):
    """A copy of the default model's GGUF, a cache of its own, every vocabulary kept."""
    monkeypatch.setenv("FMSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_cache, "MIN_TOKENS", 0)
    copy = tmp_path / "model.gguf"  # a copy: the test changes its modification time
    shutil.copyfile(gguf_path, copy)
    meta = gguf_tokenizer_metadata(copy)
    return copy, lambda: build_gguf_tokenizer(meta, copy, "llama")


def never():
    raise AssertionError("built again, though a readable entry was kept")


def test_the_kept_tokenizer_is_read_back_and_encodes_as_the_built_one(gguf):
    path, build = gguf
    built = cached_tokenizer(path, 49152, build)
    assert cache_path(path).exists()
    kept = cached_tokenizer(path, 49152, never)
    for text in TEXTS:
        assert kept.encode(text).ids == built.encode(text).ids
        assert kept.decode(built.encode(text).ids) == built.decode(built.encode(text).ids)
    assert kept.get_vocab(with_added_tokens=True) == built.get_vocab(with_added_tokens=True)


def test_a_changed_file_or_an_unreadable_entry_is_built_again(gguf):
    path, build = gguf
    cached_tokenizer(path, 49152, build)
    entry = cache_path(path)
    entry.write_text("{not json")
    calls = []
    again = cached_tokenizer(path, 49152, lambda: calls.append(1) or build())
    assert calls == [1] and again.encode(TEXTS[0]).ids == build().encode(TEXTS[0]).ids
    assert cached_tokenizer(path, 49152, never).encode(TEXTS[0]).ids == again.encode(TEXTS[0]).ids
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache_path(path) != entry
    with pytest.raises(AssertionError, match="built again"):
        cached_tokenizer(path, 49152, never)


def test_a_small_vocabulary_is_built_every_time(gguf, monkeypatch):
    path, build = gguf
    monkeypatch.setattr(tokenizer_cache, "MIN_TOKENS", 100_000)
    cached_tokenizer(path, 49152, build)
    assert not cache_path(path).exists()
