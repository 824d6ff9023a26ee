"""`fmserve bench serve`: the service under load, against the offline engine in the same run.

1. The offline engine runs the first `--requests-per-level` dev prompts at batch 32 (the
   baseline: output tokens/s with no sockets, no processes).
2. A real `fmserve serve` process is started with the same runtime settings.
3. Concurrency sweep: C clients' worth of requests in flight (C in --concurrency), each
   request a dev prompt as a chat, greedy, exactly --max-new-tokens tokens (eos ignored).
4. Poisson arrivals at --rate requests/s.
Reported per run: TTFT, inter-token latency (ITL) and end-to-end p50/p99, output tokens/s.
Steps 2-4 repeat per service variant: --overlap on,off, and with overlap on each
--launch-ahead mode; --rounds N starts the variants in turn N times (the order reversed every
other round) and pools their runs; --alternate N starts them side by side instead and takes
each run N times, the variants in turn (fmserve/bench/serve_rounds.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from rich.console import Console

from fmserve.arg_types import (add_runtime_args, non_negative_int, positive_float, positive_int,
                               positive_int_list)
from fmserve.bench import dev_texts
from fmserve.bench.serve_rounds import (alternate, overlap_summary, pool_rounds, round_ratios,
                                        run_order)
from fmserve.bench.tables import print_table
from fmserve.default_model import resolve_model_path
from ipc.async_client import AsyncClient
from ipc.client import Client
from ipc.client_errors import ServiceUnavailable
from ipc.client_messages import ChatMessage, Chunk, Finished, Usage
from ipc.sampling import SamplingParams


@dataclass
class RequestTiming:
    ttft: float
    itl: list[float]
    e2e: float
    tokens: int
    stamps: list[float] = field(default_factory=list)  # seconds since the request was sent,
    sizes: list[int] = field(default_factory=list)  # one per chunk, with its token count
    usage: Usage | None = None  # the Finished message's usage (speculation statistics)


@dataclass
class RunResult:
    name: str
    timings: list[RequestTiming]
    wall: float
    idle_share: float | None = None  # worker idle / (idle + busy) during the run
    # The service process's CPU time a step during the run (all its threads): where it nears
    # the step's time, the scheduling side and not the worker bounds the rate.
    service_cpu_ms: float | None = None

    @property
    def output_tps(self) -> float:
        return sum(t.tokens for t in self.timings) / self.wall


def dev_prompts(n: int) -> list[str]:
    texts = dev_texts()
    return [texts[i % len(texts)][:1500] for i in range(n)]


def add_load_args(p: argparse.ArgumentParser, concurrency: str) -> None:
    """The model and the closed-loop load: shared by `bench serve` and `bench http`."""
    add_runtime_args(p, dtype="fp32", checked=False, dtype_help=None)
    p.add_argument("--concurrency", type=positive_int_list, default=concurrency)
    p.add_argument("--requests-per-level", type=positive_int, default=32,
                   help="requests per concurrency level (at least the concurrency)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    add_load_args(p, concurrency="1,8,32")
    p.add_argument("--rate", type=positive_float, default=2.0,
                   help="Poisson arrival rate, requests/s (> 0)")
    p.add_argument("--poisson-requests", type=non_negative_int, default=32,
                   help="requests of the Poisson run (0: no Poisson run)")
    p.add_argument("--overlap", default="on", help="on, off, or on,off to compare in one run")
    p.add_argument("--launch-ahead", default=None, metavar="MODES",
                   help="with overlap on, the worker's scheduling.launch_ahead: one of off, "
                        "prepare, on, auto, or several (off,prepare) to compare in one run "
                        "(default: config.toml's)")
    p.add_argument("--rounds", type=int, default=1,
                   help="start the services this many times, in turn and in alternating "
                        "order (A B, B A, A B ...), and pool each one's runs: on a machine "
                        "whose speed drifts, or favours the first or last service started, "
                        "this keeps the drift and the position out of the ratios")
    p.add_argument("--alternate", type=non_negative_int, default=0, metavar="N",
                   help="start the variants side by side and take each run N times, the "
                        "variants in turn (A B, B A, ...): each pair's ratio and their median; "
                        "on a machine whose speed moves within seconds, runs taken minutes "
                        "apart are not comparable (0: off)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="passed on to `fmserve serve --set` (e.g. runtime.worker_cpu_threads=2)")
    p.add_argument("--markdown", default=None, help="also write the tables to this file")


async def one_request(client: AsyncClient, prompt: str | list[int],
                      params: SamplingParams) -> RequestTiming:
    """One request: a str is sent as a user chat message, a list of ints as token ids."""
    start = time.perf_counter()
    stamps: list[float] = []
    sizes: list[int] = []
    usage = None
    kwargs = (dict(messages=[ChatMessage("user", prompt)]) if isinstance(prompt, str)
              else dict(token_ids=list(prompt)))
    async for msg in client.generate(**kwargs, params=params):
        if isinstance(msg, Chunk) and msg.token_ids:
            stamps.append(time.perf_counter())
            sizes.append(len(msg.token_ids))
        elif isinstance(msg, Finished):
            usage = msg.usage
    end = time.perf_counter()
    itl = list(np.diff(stamps)) if len(stamps) > 1 else []
    return RequestTiming(stamps[0] - start if stamps else end - start, itl, end - start,
                         sum(sizes), [t - start for t in stamps], sizes, usage)


async def run_closed_loop(endpoint: str, prompts: list[str] | list[list[int]], concurrency: int,
                          params: SamplingParams) -> RunResult:
    queue = list(prompts)
    timings: list[RequestTiming] = []
    async with AsyncClient(endpoint) as client:
        async def worker() -> None:
            while queue:
                timings.append(await one_request(client, queue.pop(), params))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return RunResult(f"concurrency {concurrency}", timings, time.perf_counter() - start)


async def run_poisson(endpoint: str, prompts: list[str], rate: float,
                      params: SamplingParams) -> RunResult:
    rng = random.Random(0)
    async with AsyncClient(endpoint) as client:
        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, p, params)))
            await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
        return RunResult(f"poisson {rate:g} req/s", list(timings), time.perf_counter() - start)


def offline_baseline(args, path: Path, prompts: list[str], params: SamplingParams) -> float:
    from fmserve.engine import Engine
    engine = Engine(model=str(path), device=args.device, dtype=args.dtype,
                    attention_backend=args.attention_backend, max_running_requests=32,
                    progress=False)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    # Warm-up at the measured batch size: on a GPU each new shape may compile kernels first.
    engine.generate(chats, SamplingParams(max_new_tokens=4))
    start = time.perf_counter()
    outs = engine.generate(chats, params)
    return sum(len(c.token_ids) for c in outs) / (time.perf_counter() - start)


def start_service(args, path: Path, overlap: bool, extra: list[str] = (),
                  max_running_requests: int = 32, log=None) -> tuple[subprocess.Popen, str]:
    """Start `fmserve serve` on a free port and wait until it answers; `extra` are more flags
    (speculation, KV size). Its stderr goes to `log` (a file), else to a pipe read only if it
    fails to start: a long run that logs must have a file."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fmserve.cli", "serve", "--model", str(path), "--dtype",
           args.dtype, "--device", args.device, "--attention-backend", args.attention_backend,
           "--endpoint", endpoint, "--telemetry-endpoint", "tcp://127.0.0.1:0",
           "--max-running-requests", str(max_running_requests), "--log-level", "WARNING",
           "--http-port", "0",
           "--overlap" if overlap else "--no-overlap", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log or subprocess.PIPE)
    with Client(endpoint) as c:
        for _ in range(300):
            if proc.poll() is not None:
                why = (proc.stderr.read() if log is None else Path(log.name).read_bytes())
                raise RuntimeError(f"fmserve serve exited: {why.decode()[-2000:]}")
            try:
                c.health(timeout_s=1.0)
                return proc, endpoint
            except ServiceUnavailable:
                continue
    proc.kill()
    raise RuntimeError("fmserve serve did not answer within 300 s")


def stop_service(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def pct(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q) * 1000:.0f}" if values else "-"


def run_bench_serve(args: argparse.Namespace) -> int:
    console = Console()
    if args.rounds < 1:  # checked before the baseline spends minutes
        raise SystemExit(f"fmserve bench serve: --rounds is {args.rounds}; it must be at least 1")
    if args.alternate and args.rounds > 1:
        raise SystemExit("fmserve bench serve: give --rounds (services started in turn) or "
                         "--alternate (side by side), not both")
    variants = service_variants(args.overlap, args.launch_ahead)
    check_serve_flags(args)
    path = resolve_model_path(args.model)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    n = max(args.requests_per_level, max(levels))
    prompts = dev_prompts(max(n, args.poisson_requests))
    console.print(f"offline baseline: batch 32, {n} requests ...")
    baseline = offline_baseline(args, path, prompts[:n], params)
    console.print(f"offline engine: {baseline:.1f} output tok/s; starting fmserve serve ...")
    results: list[RunResult] = []
    # --alternate: every variant's service at once; else each started in turn, once a round
    groups = [variants] if args.alternate else [[v] for v in run_order(variants, args.rounds)]
    for group in groups:
        with ExitStack() as services:
            runs = []
            for overlap, launch_ahead in group:
                tag, extra = variant_flags(args, overlap, launch_ahead)
                console.print(f"starting fmserve serve ({tag}) ...")
                proc, endpoint = start_service(args, path, overlap, extra)
                services.callback(stop_service, proc)
                warm_up(endpoint, prompts, levels)
                runs.append([(name, partial(measure, endpoint, name, make)) for name, make
                             in workloads(args, endpoint, tag, levels, n, prompts, params)])
            results += alternate(runs, max(args.alternate, 1), console.print)
    per_round = results
    results = pool_rounds(results)
    header = ["run", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
              "E2E p50 ms", "E2E p99 ms", "output tok/s", "vs offline b32",
              "worker idle %", "service CPU ms/step"]
    rows = []
    for r in results:
        ttft = [t.ttft for t in r.timings]
        itl = [x for t in r.timings for x in t.itl]
        e2e = [t.e2e for t in r.timings]
        rows.append([r.name, str(len(r.timings)), pct(ttft, 50), pct(ttft, 99), pct(itl, 50),
                     pct(itl, 99), pct(e2e, 50), pct(e2e, 99), f"{r.output_tps:.1f}",
                     f"{r.output_tps / baseline:.2f}",
                     "-" if r.idle_share is None else f"{100 * r.idle_share:.1f}",
                     "-" if r.service_cpu_ms is None else f"{r.service_cpu_ms:.2f}"])
    rounds_note = (f", {args.alternate} alternated runs each pooled" if args.alternate else
                   f", {args.rounds} rounds pooled" if args.rounds > 1 else "")
    lines = print_table(console, f"serve: {args.dtype}, {args.max_new_tokens} new tokens/request, "
                                 f"offline batch-32 baseline {baseline:.1f} tok/s{rounds_note}",
                        header, rows)
    summary = overlap_summary(results)
    if args.rounds > 1 or args.alternate > 1:
        summary += round_ratios(per_round)
    for line in summary:
        console.print(line)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines + [""] + summary) + "\n")
    return 0


def check_serve_flags(args: argparse.Namespace) -> None:
    """The settings every service start gets, checked as `fmserve serve` will: a bad --set would
    otherwise surface only after the offline baseline has run (minutes)."""
    from fmserve.serve_cmd import add_serve_args, config_from_args
    serve = argparse.ArgumentParser(prog="fmserve serve")
    add_serve_args(serve)
    config_from_args(serve.parse_args(
        ["--dtype", args.dtype, "--device", args.device, "--attention-backend",
         args.attention_backend, *(f for kv in args.set for f in ("--set", kv))]))


def variant_flags(args, overlap: bool, launch_ahead: str | None) -> tuple[str, list[str]]:
    """A service variant's name in the tables and its `fmserve serve` flags beyond overlap."""
    tag = "overlap " + ("on" if overlap else "off")
    extra = [f for kv in args.set for f in ("--set", kv)]
    if launch_ahead is not None:
        tag += f" (launch-ahead {launch_ahead})"
        extra += ["--set", f"scheduling.launch_ahead={launch_ahead}"]
    return tag, extra


def warm_up(endpoint: str, prompts: list[str], levels: list[int]) -> None:
    """A few tokens at the widest level (GPU kernels compile per shape)."""
    top = max(levels)
    asyncio.run(run_closed_loop(endpoint, prompts[:top], top, SamplingParams(max_new_tokens=4)))


def workloads(args, endpoint: str, tag: str, levels: list[int], n: int, prompts: list[str],
              params: SamplingParams) -> list[tuple[str, object]]:
    """The runs of one service: (name, a function making the run's coroutine)."""
    runs = [(f"{tag}, concurrency {c}",
             lambda c=c: run_closed_loop(endpoint, prompts[:max(n, c)], c, params))
            for c in levels]
    if args.poisson_requests > 0:  # 0: the closed-loop levels only
        runs.append((f"{tag}, poisson {args.rate:g}/s", lambda: run_poisson(
            endpoint, prompts[:args.poisson_requests], args.rate, params)))
    return runs


def measure(endpoint: str, name: str, make) -> RunResult:
    """One run, with the worker's idle share and the service's CPU time a step over it (from
    the service's health counters)."""
    with Client(endpoint) as client:
        before = client.health()
        result = asyncio.run(make())
        after = client.health()
    idle = after.worker_idle_ms - before.worker_idle_ms
    busy = after.worker_busy_ms - before.worker_busy_ms
    result.name, result.idle_share = name, idle / max(idle + busy, 1e-9)
    steps = after.steps - before.steps
    if steps > 0:
        result.service_cpu_ms = (after.service_cpu_ms - before.service_cpu_ms) / steps
    return result


def service_variants(overlap: str, launch_ahead: str | None) -> list[tuple[bool, str | None]]:
    """The services one run starts: (overlap, launch-ahead mode or None for the config's), each
    overlap-on service once per launch-ahead mode (without overlap no plan ever waits, so the
    mode changes nothing there)."""
    modes: list[str | None] = [None]
    if launch_ahead is not None:
        modes = [m.strip() for m in launch_ahead.split(",")]
        unknown = sorted(set(modes) - {"off", "prepare", "on", "auto"})
        if unknown:
            raise SystemExit(f"fmserve bench serve: --launch-ahead {launch_ahead!r} has "
                             f"{unknown}; the modes are off, prepare, on and auto")
    unknown = sorted({o.strip() for o in overlap.split(",")} - {"on", "off"})
    if unknown:  # anything but "on" used to run as off
        raise SystemExit(f"fmserve bench serve: --overlap {overlap!r} has {unknown}; give on, "
                         f"off, or on,off")
    variants = []
    for o in overlap.split(","):
        on = o.strip() == "on"
        variants += [(True, m) for m in modes] if on else [(False, None)]
    return variants
