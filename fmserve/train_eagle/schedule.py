"""What the training loop runs when: the batches of each epoch and the learning-rate schedule."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


def epoch_batches(lengths: list[int], max_batch_tokens: int, seed: int, epoch: int
                  ) -> list[list[int]]:
    """Sequences of similar length together (B * longest <= max_batch_tokens), in an order fixed
    by (seed, epoch) so a resumed run sees the same batches."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    window = 512
    for w in range(0, len(order), window):
        cur: list[int] = []
        longest = 0
        for j in sorted(order[w:w + window], key=lambda j: lengths[j]):
            if cur and max(longest, lengths[j]) * (len(cur) + 1) > max_batch_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(j)
            longest = max(longest, lengths[j])
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


@dataclass
class Schedule:
    """Linear warmup, then cosine decay to min_ratio at total_steps. Mutable: a time budget
    sets total_steps once the speed is known."""

    total_steps: int
    warmup: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def default_warmup(total_steps: int) -> int:
    return min(50, max(1, total_steps // 20))
