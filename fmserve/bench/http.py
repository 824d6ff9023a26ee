"""`fmserve bench http`: the same load over the OpenAI-compatible HTTP API and over ZMQ, against
one `fmserve serve` in one run.

Closed loop at each --concurrency level: dev prompts as chats, greedy, exactly
--max-new-tokens tokens each (eos ignored). The transports take turns, the order reversed every
other round (ZMQ HTTP, HTTP ZMQ, ...), so neither gains from the machine warming or drifting.
The HTTP load generator (`run_closed_loop_http`) speaks plain OpenAI streaming chat, so it can
drive any OpenAI-compatible server; it parses SSE with msgspec, so its own cost is close to the
ZMQ client's. Given a llama-server binary (--llama-server, $FMSERVE_LLAMA_SERVER or PATH), it
drives llama.cpp's server on the same GGUF with the same load, as a third transport.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import msgspec
import numpy as np
from rich.console import Console

from fmserve.arg_types import positive_int
from fmserve.bench.peer_types import LLAMA_SERVER_INSTALL
from fmserve.bench.peers_llama_server import LlamaServerPeer, find_llama_server
from fmserve.bench.serve import (RequestTiming, RunResult, add_load_args, dev_prompts, pct,
                                 run_closed_loop, start_service)
from fmserve.bench.serve_rounds import pool_rounds
from fmserve.bench.tables import print_table
from fmserve.default_model import resolve_model_path
from ipc.sampling import SamplingParams


LLAMA_SERVER_CONTEXT = 2048  # tokens of KV per slot: the dev prompts and their answers fit


def add_bench_http_args(p: argparse.ArgumentParser) -> None:
    add_load_args(p, concurrency="1,32")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="each transport runs once a round, in alternating order")
    p.add_argument("--llama-server", default="",
                   help="also drive llama.cpp's server (this binary, else $FMSERVE_LLAMA_SERVER, "
                        "else PATH; scripts/build_llama_server.sh builds one) with the same "
                        "OpenAI load on the same GGUF")
    p.add_argument("--markdown", default=None, help="also write the tables to this file")


async def _open_stream(client: httpx.AsyncClient, url: str, body: dict):
    """The streamed response, sent again once on a fresh connection when a kept-alive one was
    closed under it before any answer (llama-server closes some after a streamed response)."""
    for attempt in (1, 2):
        request = client.build_request("POST", url, json=body)
        try:
            return await client.send(request, stream=True)
        except httpx.RemoteProtocolError:
            if attempt == 2:
                raise


async def one_http_request(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                           max_tokens: int) -> RequestTiming:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    r = await _open_stream(client, url + "/v1/chat/completions", body)
    try:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = msgspec.json.decode(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    finally:
        await r.aclose()
    end = time.perf_counter()
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    tokens = tokens or len(stamps)  # a server that sends no usage: one token a chunk
    return RequestTiming(stamps[0] - start if stamps else end - start, itl, end - start, tokens,
                         [t - start for t in stamps], [1] * len(stamps))


async def run_closed_loop_http(url: str, model: str, prompts: list[str], concurrency: int,
                               max_tokens: int) -> RunResult:
    queue = list(prompts)
    timings: list[RequestTiming] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        async def worker() -> None:
            while queue:
                timings.append(await one_http_request(client, url, model, queue.pop(),
                                                      max_tokens))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return RunResult(f"concurrency {concurrency}", timings, time.perf_counter() - start)


def run_bench_http(args: argparse.Namespace) -> int:
    console = Console()
    path = resolve_model_path(args.model)
    levels = [int(c) for c in args.concurrency.split(",")]
    n = max(args.requests_per_level, max(levels))
    prompts = dev_prompts(n)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    console.print("starting fmserve serve ...")
    proc, endpoint = start_service(args, path, True, ["--http-port", str(port)],
                                   max_running_requests=max(levels))
    results: list[RunResult] = []
    urls = {"HTTP": url}
    llama = None
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        if binary := find_llama_server(args.llama_server):
            console.print(f"starting {binary} ...")
            llama = LlamaServerPeer(SimpleNamespace(
                llama_server=binary, model_path=str(path), concurrency=levels, threads=0,
                max_context=LLAMA_SERVER_CONTEXT, device=args.device))
            urls["llama-server"] = f"http://127.0.0.1:{llama.port}"
        else:
            console.print(f"no llama-server: {LLAMA_SERVER_INSTALL}")
        asyncio.run(run_closed_loop(endpoint, prompts[:max(levels)], max(levels),
                                    SamplingParams(max_new_tokens=4)))  # warm-up
        transports = ["ZMQ", *urls]
        for r in range(args.rounds):
            order = transports if r % 2 == 0 else transports[::-1]
            for c in levels:
                for transport in order:
                    console.print(f"round {r + 1}: {transport}, concurrency {c} ...")
                    run = asyncio.run(
                        run_closed_loop(endpoint, prompts[:max(n, c)], c, params)
                        if transport == "ZMQ" else
                        run_closed_loop_http(urls[transport], model, prompts[:max(n, c)], c,
                                             args.max_new_tokens))
                    run.name = f"{transport}, concurrency {c}"
                    results.append(run)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if llama is not None:
            llama.close()
    pooled = {r.name: r for r in pool_rounds(results)}
    rows = [[r.name, str(len(r.timings)), pct([t.ttft for t in r.timings], 50),
             pct([t.ttft for t in r.timings], 99),
             pct([x for t in r.timings for x in t.itl], 50), f"{r.output_tps:.1f}"]
            for r in pooled.values()]
    lines = print_table(console, f"HTTP vs ZMQ: {args.dtype}, {args.max_new_tokens} new tokens "
                        f"per request, {args.rounds} rounds pooled",
                        ["run", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                         "output tok/s"], rows)
    summary = []
    for c in levels:
        z = pooled[f"ZMQ, concurrency {c}"]
        summary.append(_versus(pooled[f"HTTP, concurrency {c}"], z, f"concurrency {c}: HTTP/ZMQ",
                               "(targets: >= 0.95x, <= +10 ms)"))
        if llama is not None:
            summary.append(_versus(pooled[f"HTTP, concurrency {c}"],
                                   pooled[f"llama-server, concurrency {c}"],
                                   f"concurrency {c}: fmserve HTTP/llama-server", ""))
    for line in summary:
        console.print(line)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines + [""] + summary) + "\n")
    return 0


def _versus(a: RunResult, b: RunResult, what: str, targets: str) -> str:
    ttft_ms = [1000 * np.median([t.ttft for t in run.timings]) for run in (a, b)]
    return (f"- {what} throughput {a.output_tps / b.output_tps:.3f}x, TTFT p50 "
            f"{ttft_ms[0] - ttft_ms[1]:+.1f} ms {targets}").rstrip()
