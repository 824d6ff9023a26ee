"""How `fmserve bench serve` orders its services' runs and pairs them: the variants started in
turn (`--rounds`, the order reversed every other round) or side by side with their runs taken
in turn (`--alternate`), each run pooled over its repeats, and each overlap-on run's ratio to
the overlap-off run taken beside it.

Why side by side: on the 2-core VMs this project measures on, the machine's speed moves between
phases by up to 40% within seconds (docs/benchmarks.md, "Overlap on 2 cores, one wave beside
the other"). Services started one after the other are measured minutes apart, often in
different phases; two runs a few seconds apart mostly share one, and the median of many such
pairs' ratios is what the phases move least. Side by side, both services hold their model.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, TypeVar

import numpy as np


class Run(Protocol):
    """A measured run (serve.RunResult): its requests' timings over its wall time."""
    name: str
    timings: list
    wall: float
    idle_share: float | None
    service_cpu_ms: float | None

    @property
    def output_tps(self) -> float: ...


T = TypeVar("T")
R = TypeVar("R", bound=Run)


def run_order(variants: list, rounds: int) -> list:
    """The services in the order they start: every variant once a round, the order reversed
    every other round (A B, B A, ...). Runs on 2-core machines favoured the service started
    first or last by up to 15% (docs/benchmarks.md); over an even number of rounds every
    variant holds every position equally often."""
    return [v for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]


def alternate(runs: list[list[tuple[str, Callable[[], T]]]], times: int,
              say: Callable[[str], None] = lambda line: None) -> list[T]:
    """runs[s][w]: service s's run w (its name, and a call taking it). Each run w is taken
    `times` times by every service, the services in turn and the order reversed every other
    time (A B, B A, ...); the results in the order taken."""
    results = []
    for w in range(len(runs[0]) if runs else 0):
        for i in range(times):
            for s in (range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))):
                name, take = runs[s][w]
                say(f"{name} ({i + 1}/{times}) ..." if times > 1 else f"{name} ...")
                results.append(take())
    return results


# A run's figures that its repeats average (those it has: None where it was not measured).
AVERAGED = ("idle_share", "service_cpu_ms")


def pool_rounds(results: list[R]) -> list[R]:
    """One result per run name, in first-seen order: the rounds' requests pooled, their wall
    times summed (so output tok/s is over all rounds) and their idle shares and service CPU
    times a step averaged."""
    pooled: dict[str, R] = {}
    seen: dict[str, dict[str, list[float]]] = {}
    for r in results:
        if r.name not in pooled:
            pooled[r.name] = dataclasses.replace(r, timings=[], wall=0.0,
                                                 **dict.fromkeys(AVERAGED))
            seen[r.name] = {f: [] for f in AVERAGED}
        pooled[r.name].timings += r.timings
        pooled[r.name].wall += r.wall
        for f in AVERAGED:
            if getattr(r, f) is not None:
                seen[r.name][f].append(getattr(r, f))
    for name, r in pooled.items():
        for f, values in seen[name].items():
            setattr(r, f, float(np.mean(values)) if values else None)
    return list(pooled.values())


def round_ratios(results: list[Run]) -> list[str]:
    """Each overlap-on run against overlap off, round by round (the k-th run of a name is in
    round k, or in the k-th alternated pair), and the median: the spread says how far to trust
    the pooled ratio."""
    runs: dict[str, list[Run]] = {}
    for r in results:
        runs.setdefault(r.name, []).append(r)
    out = []
    for name, ons in runs.items():
        tag, _, workload = name.partition(", ")
        offs = runs.get("overlap off, " + workload)
        if not tag.startswith("overlap on") or not offs:
            continue
        ratios = [on.output_tps / off.output_tps for on, off in zip(ons, offs) if off.output_tps]
        out.append(f"- {workload}: {tag}/off by round: {ratios_text(ratios)}")
    return out


def ratios_text(ratios: list[float]) -> str:
    """Each pair's ratio in order, then their median where there are several."""
    return " ".join(f"{r:.3f}x" for r in ratios) + (
        f"; median {float(np.median(ratios)):.3f}x" if len(ratios) > 1 else "")


def overlap_summary(results: list[Run]) -> list[str]:
    """Per workload run both ways: the on/off throughput ratio, and the most overlap could give
    there, 1 / (1 - idle share without it): hiding all of the worker's idle time for free."""
    by_name = {r.name: r for r in results}
    out = []
    for r in results:
        tag, _, workload = r.name.partition(", ")
        if not tag.startswith("overlap on"):
            continue
        off = by_name.get("overlap off, " + workload)
        if off is None or not off.output_tps:
            continue
        mode = tag.removeprefix("overlap on").strip()
        line = (f"- {workload}: overlap on{' ' + mode if mode else ''}/off throughput "
                f"{r.output_tps / off.output_tps:.3f}x")
        if off.idle_share is not None and r.idle_share is not None:
            line += (f"; worker idle {100 * r.idle_share:.1f}% on, {100 * off.idle_share:.1f}% "
                     f"off; ceiling {1 / max(1 - off.idle_share, 1e-9):.3f}x")
        out.append(line)
    return out
