"""fmserve: a small local LLM serving engine (scheduler + worker processes + terminal monitor)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fmserve")
except PackageNotFoundError:  # running from a source tree that was never pip-installed
    __version__ = "0.0.0+source"
