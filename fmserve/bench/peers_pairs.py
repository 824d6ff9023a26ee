"""`fmserve bench peers`: each fmserve peer with overlap on against the same peer with it off,
round by round. On the CPU a round takes each concurrency peer after peer, so the two runs of a
round are seconds apart; on a 2-core VM whose speed moves by up to 40% within seconds
(docs/benchmarks.md), their ratio, and the median of the rounds' ratios, is what the machine's
drift moves least. The pooled figures of the throughput table mix every round's phase.
"""

from __future__ import annotations

from fmserve.bench.peer_types import PEERS, PeerResult, PointResult
from fmserve.bench.serve_rounds import ratios_text


def output_tps(point: PointResult) -> float:
    return sum(r.tokens for r in point.reqs) / point.wall if point.wall > 0 else 0.0


def overlap_pairs(results: dict[str, PeerResult]) -> list[str]:
    """One line per overlap-on peer and concurrency that ran beside its overlap-off twin."""
    lines = []
    for peer in PEERS:
        twin = peer.key.replace("-overlap", "")
        if not peer.overlap or peer.key not in results or twin not in results:
            continue
        on, off = results[peer.key], results[twin]
        if on.skipped or off.skipped:
            continue
        for c in sorted(set(on.points) & set(off.points)):
            ratios = [output_tps(a) / output_tps(b)
                      for a, b in zip(on.points[c], off.points[c]) if output_tps(b) > 0]
            if ratios:
                lines.append(f"- `{peer.key}` / `{twin}` at C = {c}: {ratios_text(ratios)}")
    return lines
