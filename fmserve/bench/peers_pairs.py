"""`fmserve bench peers`: each fmserve peer with overlap on against the same peer with it off,
and each served EAGLE peer against the same service without speculation, round by round. On
the CPU a round takes each concurrency peer after peer, so the two runs of a round are seconds
apart; on a 2-core VM whose speed moves by up to 40% within seconds
(docs/benchmarks.md), their ratio, and the median of the rounds' ratios, is what the machine's
drift moves least. The pooled figures of the throughput table mix every round's phase.
"""

from __future__ import annotations

from fmserve.bench.peer_types import PEERS, PeerResult, PointResult
from fmserve.bench.serve_rounds import ratios_text


def output_tps(point: PointResult) -> float:
    return sum(r.tokens for r in point.reqs) / point.wall if point.wall > 0 else 0.0


def pairs_sections(results: dict[str, PeerResult]) -> list[str]:
    """The report's two sections of pairs, where such pairs ran."""
    lines = []
    if pairs := overlap_pairs(results):
        lines += ["### Overlap on / off, round by round", "", "Output tok/s of each round's "
                  "overlap-on run over its overlap-off twin's in the same round (on the CPU "
                  "seconds apart), and their median (fmserve/bench/peers_pairs.py).", "",
                  *pairs, ""]
    if pairs := spec_pairs(results):
        lines += ["### Speculation on / off, round by round", "", "Output tok/s of each round's "
                  "EAGLE run over its twin's without speculation in the same round, and their "
                  "median (fmserve/bench/peers_pairs.py).", "", *pairs, ""]
    return lines


def overlap_pairs(results: dict[str, PeerResult]) -> list[str]:
    """One line per overlap-on peer and concurrency that ran beside its overlap-off twin."""
    return _pairs(results, lambda peer: peer.key.replace("-overlap", "") if peer.overlap else None)


def spec_pairs(results: dict[str, PeerResult]) -> list[str]:
    """One line per EAGLE peer and concurrency that ran beside its twin without speculation
    (the same overlap): whether speculation pays there, or costs nothing where it is off
    (issue 29's "break-even at 8 streams")."""
    return _pairs(results, lambda peer: peer.key.removesuffix(f"-{peer.spec}")
                  if peer.group == "served" and peer.spec != "off" else None)


def _pairs(results: dict[str, PeerResult], twin_of) -> list[str]:
    lines = []
    for peer in PEERS:
        twin = twin_of(peer)
        if twin is None or peer.key not in results or twin not in results:
            continue
        mine, theirs = results[peer.key], results[twin]
        if mine.skipped or theirs.skipped:
            continue
        for c in sorted(set(mine.points) & set(theirs.points)):
            ratios = [output_tps(a) / output_tps(b)
                      for a, b in zip(mine.points[c], theirs.points[c]) if output_tps(b) > 0]
            if ratios:
                lines.append(f"- `{peer.key}` / `{twin}` at C = {c}: {ratios_text(ratios)}")
    return lines
