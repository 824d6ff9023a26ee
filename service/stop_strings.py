"""Cut streamed text at the first stop string, even when it spans several tokens.

Text that could still be the beginning of a stop string is held back until the next token
decides it, so nothing past a stop is ever streamed.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""  # decoded text not yet released

    def push(self, text: str, can_stop: bool = True) -> tuple[str, bool]:
        """Add new text; returns (text safe to emit now, whether a stop string was hit).
        can_stop False (before min_new_tokens): whole stop strings are emitted as text, not
        cut, since generation goes on past them."""
        if not self.stops:
            return text, False
        self._pending += text
        first = -1 if not can_stop else min(
            (i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            out, self._pending = self._pending[:first], ""
            return out, True
        keep = self._longest_partial_suffix()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _longest_partial_suffix(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:k]):
                    best = k
                    break
        return best
