"""What a worker process receives from the service, and how it says what went wrong: shared by
the plain loop (gpu/worker_main.py) and the DP-attention group's (gpu/group_step.py)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any


def describe_exception(exc: BaseException) -> str:
    """One line for people: the error and the innermost frame it came from."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        f = frames[-1]
        text += f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"
    return text


def next_message(sock, codec, fail: Callable[..., int], accepted: tuple[type, ...],
                 takes: str) -> tuple[Any, int | None]:
    """(the next message, None), or (None, `fail`'s exit code) when it cannot be decoded or
    is none of `accepted` (`takes` names them for the log)."""
    data = sock.recv()
    try:
        msg = codec.decode(data)
    except Exception as exc:
        return None, fail(None, f"the worker received a message it cannot decode: "
                                f"{describe_exception(exc)}")
    if not isinstance(msg, accepted):
        return None, fail(None, f"the worker received a {type(msg).__name__}, which it does "
                                f"not handle (it takes {takes})")
    return msg, None
