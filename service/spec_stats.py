"""Service-wide draft acceptance of speculative decoding, for telemetry.

A verify row is one request in one step: the target checked its draft tree and accepted
`accepted` draft tokens (0 .. depth), then added the bonus token. The accept length of a row is
accepted + 1, the tokens it emitted; a mean accept length of 1.0 means no draft ever helped.
Only emitted tokens count: a row cut short by a stop or the length limit counts the drafts it
kept (its last emitted token standing for the bonus).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW_STEPS = 64  # the recent mean covers the last this-many steps that verified drafts


def count_accepted(per_position: list[int], accepted: int, sign: int = 1, start: int = 0) -> None:
    """Add `sign` to the verify steps that accepted draft depths start+1 .. accepted."""
    if accepted > len(per_position):
        per_position += [0] * (accepted - len(per_position))
    for i in range(start, accepted):
        per_position[i] += sign


@dataclass
class SpecAcceptStats:
    num_positions: int = 0  # draft depth (spec num_steps); the per-position lists have this length
    window_steps: int = WINDOW_STEPS
    verify_steps: int = 0  # lifetime verify rows
    accepted_drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # rows that accepted depth i+1
    _recent: deque[tuple[int, int]] = field(default_factory=deque)  # (rows, accepted) per step

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_positions
        self._recent = deque(maxlen=self.window_steps)

    def record_step(self, accepted: list[int]) -> None:
        """The accepted draft counts of one step's verify rows (prefill rows left out)."""
        if not accepted:
            return
        self.verify_steps += len(accepted)
        self.accepted_drafts += sum(accepted)
        self._recent.append((len(accepted), sum(accepted)))
        for n in accepted:
            count_accepted(self.accepted_per_position, n)

    def drop_accepted(self, accepted: int, dropped: int) -> None:
        """A row of the last recorded step, counted with `accepted` drafts, kept `dropped`
        fewer: a stop string ended it there."""
        self.accepted_drafts -= dropped
        rows, total = self._recent[-1]
        self._recent[-1] = (rows, total - dropped)
        count_accepted(self.accepted_per_position, accepted, -1, accepted - dropped)

    @property
    def recent_accept_length(self) -> float | None:
        """Mean tokens per verify row (accepted drafts + the bonus) over the recent window."""
        rows = sum(r for r, _ in self._recent)
        return None if not rows else (rows + sum(a for _, a in self._recent)) / rows

    @property
    def accept_rate_per_position(self) -> list[float]:
        """Lifetime share of verify rows whose draft token at depth i+1 was accepted."""
        if not self.verify_steps:
            return []
        return [n / self.verify_steps for n in self.accepted_per_position]
