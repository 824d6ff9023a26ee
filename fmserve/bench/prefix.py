"""`fmserve bench prefix`: the prefix cache off and on, on the two workloads it is for, in one
process with one engine each (the runs of the two alternate, so neither gets the quieter half
of the machine):

- **system**: every request is a chat with the same long system prompt and its own question
  (dev prompts), sent `--concurrency` at a time;
- **chat**: one conversation of `--turns` turns, each turn's prompt the whole history so far
  (the model's own answers included), one request at a time.

Printed per workload and setting: time to first token (mean over requests), wall time, the
prompt tokens against those served from the cache, and the on/off ratios. Greedy decoding,
so both settings produce the same tokens and the same work besides the prefill the cache saves
(the tokens are compared, and a difference is an error).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import Progress

from fmserve.arg_types import add_runtime_args
from fmserve.bench import dev_texts
from fmserve.bench.tables import print_table
from ipc.sampling import SamplingParams

if TYPE_CHECKING:  # torch: imported when the bench runs, not by every `fmserve` command
    from fmserve.engine import Engine

SYSTEM = ("You are the support assistant of a company that makes small open-source language "
          "model servers. Answer the user's question helpfully and concisely, in plain English, "
          "with at most three short paragraphs. If the question is about installing the "
          "software, remind the user that it needs Python 3.11 or newer and pip, and that the "
          "first start downloads the default model once. If the question is about speed, say "
          "that a single stream on a laptop decodes tens of tokens per second and that batching "
          "many requests raises the total throughput. Never invent facts, prices or dates; if "
          "you do not know something, say so and suggest where the user could look it up. ")
FOLLOW_UPS = ["Can you say that more simply?", "Give me one example.", "Why is that?",
              "What should I do next?", "Summarise your last answer in one sentence.",
              "Is there anything I should avoid?", "How long does that usually take?",
              "Thanks. One more question: what is the most common mistake?"]


@dataclass
class Run:
    workload: str
    cache: bool
    ttft_ms: list[float]
    wall_s: float
    prompt_tokens: int
    cached_tokens: int
    tokens: list[list[int]]


def add_bench_prefix_args(p: argparse.ArgumentParser) -> None:
    add_runtime_args(p, dtype="fp32", attention=False, dtype_help=(
        "fp32 (default): greedy tokens do not depend on how a batch is made up, so both "
        "settings must give the same tokens (checked); in bf16 they may differ (they do "
        "without the cache too), and only a warning says so"))
    p.add_argument("--workloads", default="system,chat", help="system, chat or both")
    p.add_argument("--num-prompts", type=int, default=16, help="system workload: requests")
    p.add_argument("--concurrency", type=int, default=4, help="system workload: at a time")
    p.add_argument("--system-repeat", type=int, default=2,
                   help="system workload: the system prompt this many times over (longer)")
    p.add_argument("--turns", type=int, default=8, help="chat workload: turns")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="each setting this many times")
    p.add_argument("--markdown", default=None, help="also write the table here")


def check_args(args: argparse.Namespace) -> list[str]:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in ("system", "chat")]
    if bad or not workloads:
        raise SystemExit(f"bench prefix: --workloads takes system, chat or system,chat; got "
                         f"{args.workloads!r}")
    for name in ("num_prompts", "concurrency", "system_repeat", "turns", "max_new_tokens",
                 "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"bench prefix: --{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}")
    return workloads


def dev_questions(n: int) -> list[str]:
    rows = [r for r in dev_texts() if len(r) < 600]
    return [rows[i % len(rows)] for i in range(n)]


def timed(engine: Engine, chats: list, params: SamplingParams) -> tuple[list[float], list[list[int]]]:
    """Run chats as one batch; per chat, ms to its first token, and its tokens."""
    start = time.perf_counter()
    submitted = engine.submit(chats, params)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid, _ in submitted}
    for out in engine.run():
        if out.token_ids and out.rid not in first:
            first[out.rid] = (time.perf_counter() - start) * 1e3
        tokens[out.rid] += out.token_ids
    return [first[rid] for rid, _ in submitted], [tokens[rid] for rid, _ in submitted]


def run_workload(engine: Engine, workload: str, args: argparse.Namespace, cache: bool) -> Run:
    # The system workload ignores eos (every request decodes the same amount); a chat's
    # answers end where the model ends them, to stay a conversation.
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens,
                            ignore_eos=workload == "system")
    pc = engine.scheduler.core.prefix_cache
    hit0, adm0 = (pc.hit_tokens, pc.admitted_tokens) if pc else (0, 0)
    start = time.perf_counter()
    ttft: list[float] = []
    tokens: list[list[int]] = []
    prompt_tokens = 0
    if workload == "system":
        system = SYSTEM * args.system_repeat
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                 for q in dev_questions(args.num_prompts)]
        prompt_tokens = sum(len(engine.encode(c)) for c in chats)
        for i in range(0, len(chats), args.concurrency):
            t, ids = timed(engine, chats[i:i + args.concurrency], params)
            ttft += t
            tokens += ids
    else:
        history = [{"role": "system", "content": SYSTEM},
                   {"role": "user", "content": dev_questions(1)[0]}]
        for turn in range(args.turns):
            prompt_tokens += len(engine.encode(history))
            t, ids = timed(engine, [history], params)
            ttft += t
            tokens += ids
            history = history + [
                {"role": "assistant",
                 "content": engine.tokenizer.decode(ids[0], skip_special_tokens=True)},
                {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    wall = time.perf_counter() - start
    hit = (pc.hit_tokens - hit0) if pc else 0
    return Run(workload, cache, ttft, wall, prompt_tokens, hit, tokens)


def run_bench_prefix(args: argparse.Namespace) -> int:
    workloads = check_args(args)
    console = Console()
    opts = dict(device=args.device, dtype=args.dtype, progress=False, overlap=True)
    from fmserve.engine import Engine

    engines = {False: Engine(model=args.model, **opts),
               True: Engine(model=args.model, prefix_cache=True, **opts)}
    # Warm-up: kernels, allocator; and the cache's own first fill is part of what is measured.
    for engine in engines.values():
        engine.generate(["Hello."], SamplingParams(max_new_tokens=4))
    runs: list[Run] = []
    order = [(w, c) for _ in range(args.rounds) for w in workloads for c in (False, True)]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench prefix", total=len(order))
        for i, (w, c) in enumerate(order):
            if i % 4 >= 2:  # every other pair in the opposite order
                c = not c
            progress.update(task, description=f"{w}, prefix cache {'on' if c else 'off'}")
            if c:  # each run starts from an empty cache: what it shares, it shares in the run
                engines[True].scheduler.core.prefix_cache.evict(1 << 30)
            runs.append(run_workload(engines[c], w, args, c))
            progress.advance(task)
    for w in workloads:
        off = [r for r in runs if r.workload == w and not r.cache]
        on = [r for r in runs if r.workload == w and r.cache]
        differ = sum(a != b for r in off[1:] + on for a, b in zip(r.tokens, off[0].tokens))
        if differ and args.dtype == "fp32":
            raise SystemExit(f"bench prefix: the {w} workload's tokens differ with the prefix "
                             f"cache on and off (greedy, fp32): a bug, please report it")
        if differ:
            console.print(f"[yellow]{w}: {differ} requests' greedy tokens differ between runs "
                          f"in {args.dtype} (its rounding depends on how a batch is made up, "
                          f"with or without the cache); the figures compare slightly different "
                          f"work[/yellow]")
    lines = render(runs, workloads, console)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


def render(runs: list[Run], workloads: list[str], console: Console) -> list[str]:
    header = ["workload", "prefix cache", "requests", "TTFT mean ms", "wall s",
              "prompt tokens", "from the cache", "TTFT on/off", "wall on/off"]
    rows = []

    def pooled(rs: list[Run]) -> tuple[float, float, int, int, int]:
        ttft = [t for r in rs for t in r.ttft_ms]
        return (sum(ttft) / len(ttft), sum(r.wall_s for r in rs), len(ttft),
                sum(r.prompt_tokens for r in rs), sum(r.cached_tokens for r in rs))

    for w in workloads:
        off = pooled([r for r in runs if r.workload == w and not r.cache])
        for cache in (False, True):
            ttft, wall, n, prompt, cached = pooled([r for r in runs if r.workload == w
                                                    and r.cache == cache])
            rows.append([w, "on" if cache else "off", str(n), f"{ttft:.0f}", f"{wall:.2f}",
                         str(prompt), f"{cached} ({cached / max(1, prompt):.0%})",
                         f"{off[0] / ttft:.2f}x faster" if cache else "-",
                         f"{off[1] / wall:.2f}x faster" if cache else "-"])
    return print_table(console, "prefix cache off and on", header, rows)
