"""Whether a decode batch drafts: spec.disable_above_batch_size, fixed or measured ("auto").

Speculation trades one verify forward of num_draft_tokens rows per request (plus the draft
head's forwards) for the drafts it accepts. At batch 1 a CPU streams the weights once either
way, so verifying 4 rows costs little more than decoding 1; at batch 8 the matmuls are no
longer bound by reading the weights, a verify costs ~4x a decode, and speculation loses (on 2
cores it measured 0.79-0.85x of plain decoding at batch 4). Where that point lies depends on
the CPU, the model, the head and the prompts, so "auto" measures it while serving: per batch
size class (1, 2, 3-4, 5-8, ...) it keeps the seconds per emitted token of drafting steps and
of plain steps over their last ~1 / SMOOTHING steps (both run from the same state: the head
catches up over the tokens plain steps skipped before a request drafts again,
gpu/eagle/head_lag.py; that catch-up is timed apart and charged to the plain way per token it
covers), and drafts where drafting is the faster. A class tries drafting first, then plain
for a few steps, then keeps the winner and re-measures the loser now and then, so a change
(longer contexts, a different acceptance) is noticed. The window spans several requests on
purpose: one request's acceptance swings (1.3 to 3.6 tokens a step over 16 dev prompts at one
stream), and following each request's ran 0.98x plain where always drafting ran 1.08x.
A class above one where drafting did not measure clearly faster (HEADED_IF_FASTER_BY) is not
tried (on a CPU a verify only costs more the more requests share it), and requests admitted
into such a batch run without the head at all (`admits_headless`, gpu/eagle/head_lag.py): at
8 streams "auto" then served 0.98-1.0x the plain service once measured, where following along
had cost ~8%. The classes measured both ways are kept between runs, per machine, model, head and
settings (gpu/eagle/gate_memory.py): a restarted service starts from their verdicts.

Measured on the host around the decode forward: on a CPU that is the forward itself. On a GPU
the launch returns before the device is done, so there "auto" is a fixed limit instead,
GPU_AUTO_LIMIT, from an H100 with both steps as CUDA graphs (docs/benchmarks.md): EAGLE-3 served
1.04-1.13x plain decode at one stream and 0.66-0.69x at eight (a graphed plain step of a small
model costs about the same at 1, 2 or 8 rows; a verify of 5-12 rows a request does not), so it
drafts up to two requests, about where the two cross (limits of 1, 2 and 4 measured since, with
the plain steps as graphs too: 2 and 4 alike, 1 behind). Above it, requests run headless
(`drops_heads`, head_lag.py); under a fixed limit the head follows every plain step.
Tensor-parallel ranks and deterministic mode do not measure either (each rank would time
itself, and they must all take the same way; a timing is not deterministic): there "auto"
always drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TRIALS = 4  # steps each way before a class decides
REPROBE_EVERY = 16  # steps of a class between two measurements of the losing way
SMOOTHING = 0.03  # weight of the newest step in a way's running seconds and tokens
CLOSE = 1.25  # a loser within this factor of the winner is probed every REPROBE_EVERY steps
FAR_BEHIND = 8  # ... else every REPROBE_EVERY * FAR_BEHIND steps
# Requests admitted into a class keep the head only where drafting measured at least this much
# faster per token than plain; elsewhere they run headless (gpu/eagle/head_lag.py), and larger
# classes are not tried. The decode steps alone do not show what drafting costs around them (the
# head over every prompt, a chunk and a verify as two target forwards): served at 8 streams,
# drafting measured 2.04 against plain's 2.00 ms a token and the service ran 0.79x plain.
HEADED_IF_FASTER_BY = 1.1
# ... from this batch size class up; below it only once both ways have SETTLED_STEPS steps
# measured, over this run and earlier ones. One stream's trials ride on one request's
# acceptance (1.3 to 3.6 tokens a step over the dev prompts): a verdict from them alone could
# leave every later request headless, never drafting, for HEADLESS_REPROBE steps (seen: a
# whole bench). But a head kept where drafting does not pay costs: on the 2-core AVX512-BF16
# EPYC, where one stream drafts about as fast as it decodes, the gate's probes and the head's
# catch-ups left the chain at 0.92x the plain engine (docs/benchmarks.md).
HEADLESS_FROM = 4
SETTLED_STEPS = 64
# Steps of such a class, its batches holding headless requests, before it admits with the
# head again so that a batch can draft and be measured (each such round costs the head's work
# over a batch's worth of requests).
HEADLESS_REPROBE = REPROBE_EVERY * FAR_BEHIND * 8
# Each probe in a row that finds drafting still losing doubles that wait, up to 2 ** this
# times: a probe's requests carry the head until a batch of them drafts, and at 8 streams on
# 2 cores a wave holding one ran 0.83-0.93x its twin (docs/benchmarks.md).
HEADLESS_BACKOFF = 3
RESTORED_STEPS = 2 * TRIALS  # the weight of a class's measurements kept from an earlier run
GPU_AUTO_LIMIT = 2  # what "auto" means on a GPU (the module docstring)


@dataclass
class Way:
    """Running means of a way's step seconds and tokens. Their ratio, not a running mean of
    each step's ratio: a drafting step emits 1 to 4 tokens a request, and the mean of
    seconds / tokens over such steps overstates its cost per token (by ~25% at one stream on
    the 2-core EPYC), which kept "auto" from drafting where it was the faster."""
    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0
    # Whether this process ran the way at this class: its first step is counted but not
    # measured (new shapes, first calls: 2-3x).
    warm: bool = False
    seen: int = 0  # steps counted over every run (`steps` restarts from RESTORED_STEPS)

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else math.nan

    def add(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.seen += 1
        if not self.warm:
            self.warm = True
            return
        # The plain mean of the first 1 / SMOOTHING steps, then a running mean that long.
        weight = max(SMOOTHING, 1.0 / (self.steps - 1))
        self.seconds += weight * (seconds - self.seconds)
        self.tokens += weight * (max(tokens, 1) - self.tokens)


@dataclass
class SizeClass:
    drafting: Way
    plain: Way
    since_probe: int = 0
    # The head's catch-up per token it covers before this class drafts (gpu/eagle/head_lag.py):
    # a plain step's deferred cost, added to the plain way's; 0 until one is measured. Per
    # class: one stream's catch-ups cover a token or two (~1.5 ms a token), a batch's many.
    catch_up_per_token: float = 0.0
    lost_probes: int = 0  # probes of drafting in a row begun while it lost here

    def plain_cost(self) -> float:
        return self.plain.seconds_per_token + self.catch_up_per_token


def size_class(batch_size: int) -> int:
    """1, 2, 4, 8, ...: the power of two at or above the batch size."""
    return 1 << max(batch_size - 1, 0).bit_length()


class SpecGate:
    def __init__(self, limit: int | str, measured: bool, unmeasured_auto: int = 0,
                 drops_heads: bool = False) -> None:
        """`limit`: spec.disable_above_batch_size (an int, 0 = always draft, or "auto");
        `measured`: whether host time measures a step (a CPU device); `unmeasured_auto`: the
        limit "auto" means where it does not (GPU_AUTO_LIMIT on a GPU, 0 elsewhere);
        `drops_heads`: requests admitted above that limit run headless (head_lag.py, "drop")."""
        self.auto = limit == "auto" and measured
        self.limit = unmeasured_auto if limit == "auto" and not measured else limit
        self.drops_heads = drops_heads and int(self.limit) > 0
        self.classes: dict[int, SizeClass] = {}

    def drafts(self, batch_size: int, can_draft: bool = True) -> bool:
        """`can_draft` False: the batch holds a headless request (gpu/eagle/head_lag.py); the
        step is counted, and a probe that falls due waits for a batch that can draft."""
        if not self.auto:
            return can_draft and (self.limit in (0, "auto") or batch_size <= int(self.limit))
        c = self._class(batch_size)
        if self._loses_below(batch_size) or not can_draft:  # drafting only loses more at
            c.since_probe += 1  # larger batches
            return False
        if c.drafting.steps < TRIALS:
            return True
        if c.plain.steps < TRIALS:
            return False
        drafting = c.drafting.seconds_per_token
        plain = c.plain_cost()
        faster = drafting <= plain
        # A loser far behind is measured again less often: at 32 streams a drafting step costs
        # several plain ones, and a probe every REPROBE_EVERY steps cost ~20% of the service's
        # speed there, while a close call (one stream) is worth watching.
        close = max(drafting, plain) <= CLOSE * min(drafting, plain)
        if c.since_probe >= (REPROBE_EVERY if close else REPROBE_EVERY * FAR_BEHIND):
            c.since_probe = 0  # the loser once more, then back to the winner
            if self._loses(size_class(batch_size), c):
                c.lost_probes += 1
            return not faster
        c.since_probe += 1
        return faster

    def admits_headless(self, batch_size: int) -> bool:
        """Whether a request admitted into a batch of this size runs without the head
        (gpu/eagle/head_lag.py): "auto" did not measure drafting HEADED_IF_FASTER_BY faster
        than plain at its class or a smaller one (from HEADLESS_FROM up; below it, once both
        ways have SETTLED_STEPS steps), so speculation costs nothing where it is off."""
        if self.drops_heads:
            return batch_size > int(self.limit)
        key = size_class(batch_size)
        c = self.classes.get(key) if self.auto else None
        # Once its probe of drafting is due, the class admits requests with the head again,
        # so a batch of them can draft once more and the gate sees a change (it never could
        # while every batch held a headless request).
        loses = c is not None and self._loses(key, c)
        if c is not None and not loses:
            c.lost_probes = 0  # drafting caught up: the next loss waits the least again
        due = loses and c.since_probe >= HEADLESS_REPROBE << min(c.lost_probes, HEADLESS_BACKOFF)
        return (loses and not due) or self._loses_below(batch_size)

    def _loses(self, key: int, c: SizeClass) -> bool:
        if c.drafting.steps < TRIALS or c.plain.steps < TRIALS or key < HEADLESS_FROM and min(
                c.drafting.seen, c.plain.seen) < SETTLED_STEPS:
            return False
        # No catch-up here: a headless request never catches up.
        return c.drafting.seconds_per_token * HEADED_IF_FASTER_BY > c.plain.seconds_per_token

    def _loses_below(self, batch_size: int) -> bool:
        """Whether drafting measured slower at a smaller class: on a CPU a verify's rows cost
        more the more requests share it, so a larger batch is not tried (its trials of
        drafting cost ~3x a plain step each at 8-32 streams)."""
        key = size_class(batch_size)
        return any(k < key and self._loses(k, c) for k, c in self.classes.items())

    def decided(self) -> dict[int, SizeClass]:
        """The classes that measured both ways (gpu/eagle/gate_memory.py keeps them)."""
        return {k: c for k, c in self.classes.items()
                if c.drafting.steps >= TRIALS and c.plain.steps >= TRIALS}

    def restore(self, classes: dict[int, SizeClass]) -> None:
        """Start from an earlier run's measurements (`decided`): each way counts as
        RESTORED_STEPS steps, so this run's soon outweigh them, and its first step here is not
        measured."""
        for key, c in classes.items():
            for way in (c.drafting, c.plain):
                way.steps, way.warm = min(way.steps, RESTORED_STEPS), False
            c.since_probe = 0
            self.classes[key] = c

    def record(self, batch_size: int, drafted: bool, seconds: float, tokens: int) -> None:
        """One decode step: its host seconds and the tokens it emitted (accepted drafts plus
        one per request when drafting, one per request otherwise)."""
        if self.auto:
            c = self._class(batch_size)
            (c.drafting if drafted else c.plain).add(seconds, tokens)

    def record_catch_up(self, batch_size: int, seconds: float, tokens: int) -> None:
        """One catch-up of the head over `tokens` tokens that plain steps skipped, before a
        drafting step of `batch_size` requests. Timed apart from the step it happens in:
        there it would make drafting look slower by the plain steps' deferred work."""
        if self.auto and tokens > 0:
            c, value = self._class(batch_size), seconds / tokens
            c.catch_up_per_token = value if c.catch_up_per_token == 0.0 else (
                (1 - SMOOTHING) * c.catch_up_per_token + SMOOTHING * value)

    def _class(self, batch_size: int) -> SizeClass:
        key = size_class(batch_size)
        if key not in self.classes:
            self.classes[key] = SizeClass(Way(), Way())
        return self.classes[key]
