"""Where fetched models are kept, and the errors of fetching and naming one (shared by the
default model, fmserve/default_model.py, and the named ones such as fmserve/gemma3_model.py)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "FMSERVE_CACHE"


class ModelFetchError(RuntimeError):
    """A model could not be downloaded, extracted or verified."""


class ModelPathError(ValueError):
    """A --model argument names nothing we can load."""


def model_cache_dir() -> Path:
    """Directory fetched models are kept in: $FMSERVE_CACHE, else ~/.cache/fmserve/models."""
    if env := os.environ.get(ENV_CACHE):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "fmserve" / "models"
