"""Where fetched models are kept, and the errors of fetching and naming one (shared by the
default model, fmserve/default_model.py, and the named ones such as fmserve/gemma3_model.py)."""

from __future__ import annotations

from ipc.cache_dirs import ENV_CACHE, model_cache_dir  # one rule, the worker's too

__all__ = ["ENV_CACHE", "ModelFetchError", "ModelPathError", "model_cache_dir"]


class ModelFetchError(RuntimeError):
    """A model could not be downloaded, extracted or verified."""


class ModelPathError(ValueError):
    """A --model argument names nothing we can load."""
