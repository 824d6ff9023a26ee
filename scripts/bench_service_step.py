"""The service's own time a step, with a worker that answers at once (fmserve/bench/
instant_worker.py): a real `fmserve serve` process, real ZMQ, a real client driving C greedy
streams of dev prompts, and no model. The steps then run as fast as the service can plan,
detokenize, meter and reply, as on a fast GPU, where that side's time a step is the worker's
idle (issue 29's target: idle <= 1%). Per checkout and concurrency it prints steps a second
and the service process's CPU ms a step (`Stats.service_cpu_ms`), and with several checkouts
each one's ratio to the first, round by round (all started at once, then each run taken on
each in turn, their order reversed every other round: seconds apart) and their median:

    python scripts/bench_service_step.py --trees new=.,old=/tmp/old --rounds 4

The same checkout twice with settings apart, e.g. a speculating service (its rows answered as
the EAGLE step's plain decodes, as a GPU's batches above the gate's limit) against the plain one:

    python scripts/bench_service_step.py --trees plain=.,spec=. \
        --tree-args "spec=--spec-algorithm eagle3" --rounds 10

A checkout without fmserve/bench/instant_worker.py (an older commit) needs that file copied
in. docs/benchmarks.md ("The service's own time a step") has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fmserve.bench import dev_texts
from fmserve.bench.serve import run_closed_loop
from ipc.async_client import AsyncClient
from ipc.client import Client
from ipc.client_errors import ServiceUnavailable
from ipc.sampling import SamplingParams

SERVE = ("import sys, service.worker_spawn as spawn; "
         "spawn.WORKER_MODULE = 'fmserve.bench.instant_worker'; "
         "from fmserve.cli import main; sys.exit(main(['serve', *sys.argv[1:]]))")


def start(tree: Path, model: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    sockets = tempfile.mkdtemp(prefix="fmserve-bench-")  # ipc endpoints: no port to race for
    endpoint = f"ipc://{sockets}/service"
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE, "--model", model, "--endpoint", endpoint, "--http-port", "0",
         "--telemetry-endpoint", f"ipc://{sockets}/telemetry", *extra],
        cwd=tree, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    with Client(endpoint) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the service of {tree} exited early:\n{log.read_text()}")
            try:
                client.health(timeout_s=1.0)
                return proc, endpoint
            except ServiceUnavailable:
                if time.monotonic() > deadline:
                    raise


async def load(endpoint: str, texts: list[str], concurrency: int, tokens: int) -> dict:
    """Closed loop of `concurrency` streams over `texts` (`fmserve bench serve`'s); steps/s and
    service CPU ms a step between two health reads."""
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    await run_closed_loop(endpoint, texts[:concurrency], concurrency, params)  # warm
    async with AsyncClient(endpoint) as client:
        before = await client.health()
        run = await run_closed_loop(endpoint, texts, concurrency, params)
        after = await client.health()
    steps, total = after.steps - before.steps, sum(t.tokens for t in run.timings)
    assert total == len(texts) * tokens, f"{total} tokens, expected {len(texts) * tokens}"
    return {"steps_s": steps / run.wall,
            "cpu_ms": (after.service_cpu_ms - before.service_cpu_ms) / steps,
            "idle": (after.worker_idle_ms - before.worker_idle_ms) / (run.wall * 1000.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="this=.", help="NAME=PATH,... checkouts to compare")
    ap.add_argument("--model", default="default",
                    help="a GGUF (default: the default model): its tokenizer, and the capacity "
                         "the instant worker reads from its header")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--serve-args", default="", help="more `fmserve serve` flags, e.g. "
                    "\"--overlap\" (on a GPU the default; \"auto\" keeps it off on 2 cores)")
    ap.add_argument("--tree-args", action="append", default=[], metavar="NAME=ARGS",
                    help="more `fmserve serve` flags for one checkout's service alone")
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens a request")
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in
             (t.split("=", 1) for t in args.trees.split(","))]
    if malformed := [a for a in args.tree_args if "=" not in a]:
        ap.error(f"--tree-args takes NAME=ARGS (a name from --trees); got {malformed}")
    own_args = dict(a.split("=", 1) for a in args.tree_args)
    if unknown := set(own_args) - {name for name, _ in trees}:
        ap.error(f"--tree-args names {sorted(unknown)}, not in --trees")
    levels = [int(c) for c in args.concurrency.split(",")]
    texts = dev_texts()
    runs: dict[tuple[str, int], list[dict]] = {}
    logs = Path(tempfile.gettempdir())
    services = [(name, *start(tree, args.model,
                              args.serve_args.split() + own_args.get(name, "").split(),
                              logs / f"fmserve-bench-service-step-{name}.log"))
                for name, tree in trees]  # all up at once: the runs alternate seconds apart
    try:
        for r in range(args.rounds):
            for c in levels:
                for name, _, endpoint in services if r % 2 == 0 else services[::-1]:
                    run = asyncio.run(load(endpoint, texts[:c * args.requests_per_stream], c,
                                           args.tokens))
                    runs.setdefault((name, c), []).append(run)
                    print(f"round {r + 1} {name:>8} concurrency {c:>3}: {run['steps_s']:7.0f} "
                          f"steps/s, service CPU {run['cpu_ms']:.3f} ms a step, worker idle "
                          f"{100 * run['idle']:.1f}%", flush=True)
    finally:
        for _, proc, _ in services:
            proc.send_signal(2)
        for _, proc, _ in services:
            proc.wait(timeout=60)
    base = trees[0][0]
    print(f"\n| checkout | concurrency | steps/s (median) | service CPU ms a step (median) |"
          f" CPU a step / {base}'s, round by round | median |\n|---|---|---|---|---|---|")
    for name, _ in trees:
        for c in levels:
            mine, theirs = runs[(name, c)], runs[(base, c)]
            ratios = [m["cpu_ms"] / t["cpu_ms"] for m, t in zip(mine, theirs)]
            print(f"| {name} | {c} | {statistics.median(m['steps_s'] for m in mine):.0f} | "
                  f"{statistics.median(m['cpu_ms'] for m in mine):.3f} | "
                  f"{', '.join(f'{x:.3f}' for x in ratios)} | {statistics.median(ratios):.3f}x |")


if __name__ == "__main__":
    main()
