"""Where fmserve keeps files between runs: the default model (fmserve/default_model.py) and the
compiled decode step's inductor caches (gpu/compiled_decode.py). Here, in the shared layer,
so the worker finds the same directory the command line does.

    FMSERVE_CACHE   the cache directory (default $XDG_CACHE_HOME/fmserve/models, else
                    ~/.cache/fmserve/models)
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE = "FMSERVE_CACHE"


def model_cache_dir() -> Path:
    """Directory the default model is kept in: $FMSERVE_CACHE, else ~/.cache/fmserve/models."""
    if env := os.environ.get(ENV_CACHE):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "fmserve" / "models"


def compile_cache_dir() -> Path:
    """Directory of inductor's on-disk caches (compiled decode graphs, their C++ builds)."""
    return model_cache_dir() / "inductor"
