"""`fmserve top`: the Textual monitor. Depends on `ipc` only (never `service` or `gpu`)."""

from tui.app import TopApp

__all__ = ["TopApp"]
