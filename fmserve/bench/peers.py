"""`fmserve bench peers`: fmserve against the engines a user would pick instead (issue 8).

Every peer runs the same prompts (the dev set's, cut to --max-prompt-tokens and rendered with
the chat template into token ids once, here), the same GGUF weights and the same greedy
settings (exactly --max-new-tokens tokens, eos ignored), in one run. Repetitions go round robin
over the peers, so drift on a shared machine hits all of them alike.

Peers (select with --peers, shell-style patterns over these keys):
    hf-b1                 transformers generate, batch 1 (the baseline of every ratio)
    hf-batched            transformers generate, one left-padded batch of C prompts
    hf-prompt-lookup      transformers assisted generation without an assistant model
                          (prompt_lookup_num_tokens: n-gram drafts from the prompt)
    hf-assisted           transformers assisted generation with --assistant-model
    llama-cpp             llama.cpp through llama-cpp-python (one sequence at a time), when
                          it is importable
    llama-server          llama.cpp's own server with --parallel slots (continuous batching)
                          driven by C concurrent HTTP streams, when the binary is found
    offline[-overlap][-chain|-tree]   the fmserve Engine in one process
    served[-overlap][-chain|-tree]    `fmserve serve` driven by C concurrent clients

At each concurrency C a peer serves C streams in a closed loop (a new request as soon as one
finishes; transformers: batches of C). In-process peers run in a spawned child process per
model load, so each has its own memory; a service is its own process tree.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fmserve.arg_types import (add_runtime_args, fraction, non_negative_float, non_negative_int,
                               positive_int, positive_int_list)
from fmserve.bench import DEV_PROMPTS
from fmserve.bench.peer_types import (BASELINE, LLAMA_INSTALL, LLAMA_SERVER_INSTALL,
                                     NOT_APPLICABLE, PEERS, QUICK_LEAVES_OUT, Peer, PeerConfig,
                                     PeerResult)
from fmserve.bench.peers_llama_server import LlamaServerPeer, find_llama_server
from fmserve.bench.peers_served import ServedPeer
from fmserve.bench.peers_workers import ChildGroup
from fmserve.bench.spec import spec_settings_for
from fmserve.jsonl import read_prompts
from gpu.cpu_load import OtherWork


QUICK = dict(num_prompts=3, max_prompt_tokens=96, max_new_tokens=16, concurrency="1,8",
             repetitions=1)
FULL = dict(num_prompts=16, max_prompt_tokens=256, max_new_tokens=64, concurrency="1,8,32",
            repetitions=2)


def add_bench_peers_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"a short run (< 5 min on 2 cores): {QUICK}; without it: {FULL}")
    add_runtime_args(p, model_help="the GGUF every peer loads",
                     device_help="auto: the CPU, and also a CUDA GPU when one is available (its "
                                 "own section); cpu; cuda",
                     dtype_help="one dtype for every peer; auto follows fmserve's rule per device")
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="torch threads of every peer (0: torch's default in-process, the "
                        "service's own rule for a served worker)")
    p.add_argument("--prompts", default=str(DEV_PROMPTS), help="JSONL with a 'prompt' field")
    p.add_argument("--num-prompts", type=positive_int, default=None)
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="cut each prompt's text to this many tokens before the chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=None)
    p.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 (the default): greedy; else every peer samples at this temperature, "
                        "with the cuts below (llama.cpp's own defaults replaced by them)")
    p.add_argument("--top-k", type=non_negative_int, default=0,
                   help="with --temperature: every peer's top-k cut (0, the default: none; "
                        "llama.cpp's own default is 40)")
    p.add_argument("--top-p", type=fraction, default=1.0,
                   help="with --temperature: top-p (1, the default: none; llama.cpp's 0.95)")
    p.add_argument("--min-p", type=fraction, default=0.0,
                   help="with --temperature: min-p (0, the default: none; llama.cpp's 0.05)")
    p.add_argument("--concurrency", type=positive_int_list, default=None,
                   help="concurrent streams, e.g. 1,8,32")
    p.add_argument("--repetitions", type=positive_int, default=None, help="round-robin rounds")
    p.add_argument("--peers", default="*", help="comma-separated patterns over the peer keys: "
                   + ", ".join(p.key for p in PEERS) + f" ({BASELINE} always runs)")
    p.add_argument("--prompt-lookup-tokens", type=positive_int, default=10,
                   help="transformers prompt_lookup_num_tokens")
    p.add_argument("--assistant-model", default="",
                   help="a smaller model with the same tokenizer for transformers assisted "
                        "generation (a .gguf or a model directory)")
    p.add_argument("--llama-server", default="",
                   help="the llama-server binary (default: $FMSERVE_LLAMA_SERVER, then PATH)")
    p.add_argument("--spec-algorithm", default="eagle3", choices=["eagle3", "eagle"])
    p.add_argument("--draft-model", default="", help="EAGLE head (default: the shipped one)")
    # The service's default chain (config.toml: 3 steps, 4 tokens) and a tree as wide: on a CPU
    # with 4-bit decode a verify of more than 4 tokens costs twice as much.
    p.add_argument("--spec-num-steps", type=int, default=3)
    p.add_argument("--tree-topk", type=int, default=2)
    p.add_argument("--tree-draft-tokens", type=int, default=4)
    p.add_argument("--out-dir", default="docs/benchmarks",
                   help="where peers.md, peers.json and the PNG plots go")
    p.add_argument("--note", default="", help="a line of text for the report (e.g. 'contended')")


def load_prompts(path: str, n: int, max_tokens: int, tokenizer) -> list[list[int]]:
    """The first n prompts (cycled), each cut to max_tokens text tokens, as chat token ids."""
    rows = read_prompts(path)
    out = []
    for i in range(n):
        text = tokenizer.decode(tokenizer.encode(rows[i % len(rows)])[:max_tokens])
        out.append(tokenizer.encode_chat([{"role": "user", "content": text}],
                                         add_generation_prompt=True))
    return out


def requests_for(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """Batch 1: every prompt once; C streams: a whole number of waves of C, prompts cycled."""
    n = len(prompts) if concurrency == 1 else concurrency * math.ceil(len(prompts) / concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def selected_peers(args) -> dict[str, str]:
    """key -> reason it is left out ("" = runs)."""
    patterns = [p.strip() for p in args.peers.split(",") if p.strip()]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatch(peer.key, p) for peer in PEERS)]
    if unmatched or not patterns:  # else a typo runs the baseline alone, for minutes
        what = f"{', '.join(unmatched)} matches no peer" if unmatched else "names no peer"
        raise ValueError(f"--peers {args.peers!r}: {what}; the peers are "
                         f"{', '.join(p.key for p in PEERS)} (patterns such as served-* work, "
                         f"separated by commas)")
    out = {}
    for peer in PEERS:
        chosen = peer.key == BASELINE or any(fnmatch.fnmatch(peer.key, p) for p in patterns)
        if not chosen:
            out[peer.key] = "not selected (--peers)"
        elif args.quick and peer.key in QUICK_LEAVES_OUT and args.peers == "*":
            out[peer.key] = "not run in --quick (each is one more service start; run the full mode)"
        elif peer.key == "hf-assisted" and not args.assistant_model:
            out[peer.key] = ("no smaller assistant model sharing this model's tokenizer is "
                             "available offline here; give --assistant-model to run it "
                             "(prompt-lookup decoding is transformers' assisted generation "
                             "without one, and it ran)")
        elif peer.group == "hf" and not _importable("transformers"):
            out[peer.key] = "transformers is not installed (`pip install transformers accelerate`)"
        elif peer.key == "llama-cpp" and not _importable("llama_cpp"):
            out[peer.key] = f"llama-cpp-python is not installed (`{LLAMA_INSTALL}`)"
        elif peer.key == "llama-server" and not find_llama_server(args.llama_server):
            where = args.llama_server or os.environ.get("FMSERVE_LLAMA_SERVER", "")
            out[peer.key] = ((f"{where} is not an executable file; " if where else
                              "no llama-server binary (not on PATH, no --llama-server); ")
                             + LLAMA_SERVER_INSTALL)
        else:
            out[peer.key] = ""
    return out


def busy_cores(seconds: float) -> float | None:
    """How many cores other processes kept busy over the next `seconds` (this one sleeps), from
    /proc/stat; None where it cannot be read. Unlike the 1-minute load average, it is not
    raised by work that ended a few seconds ago."""
    with OtherWork() as other:
        time.sleep(seconds)
    return other.cores


def _importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def applies(peer: Peer, concurrency: int) -> bool:
    return not ((peer.only == "batch1" and concurrency > 1) or
                (peer.only == "batched" and concurrency == 1))


def peer_config(args, model_path: Path, device: str, prompts: list[list[int]],
                spec_settings: dict) -> PeerConfig:
    """`spec_settings`: the validated SpecSettings of the speculative shapes ("chain", "tree")
    whose peers run."""
    import torch
    from gpu.device import resolve_dtype
    dtype = args.dtype
    if dtype == "auto":
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
            resolve_dtype("auto", torch.device(device))]
    spec = {name: (st.algorithm, st.draft_model, st.num_steps, st.topk, st.num_draft_tokens)
            for name, st in spec_settings.items()}
    concurrency = [int(c) for c in args.concurrency.split(",")]
    longest = max(len(p) for p in prompts)
    reserve = max([2 * max(s[2] * s[3], s[4]) for s in spec.values()], default=0)
    per_request = longest + args.max_new_tokens + reserve + 2 * 16
    return PeerConfig(str(model_path), device, dtype, args.attention_backend, args.threads,
                      args.max_new_tokens, concurrency,
                      max_kv_tokens=16 * math.ceil((per_request * max(concurrency) + 64) / 16),
                      max_context=longest + args.max_new_tokens + 16, spec=spec,
                      prompt_lookup_tokens=args.prompt_lookup_tokens,
                      assistant_model=args.assistant_model,
                      llama_server=find_llama_server(args.llama_server),
                      fmserve_dtype=args.dtype, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, min_p=args.min_p)


# --- running ------------------------------------------------------------------------------


def units(peers: list[Peer]) -> list[tuple[str, list[Peer]]]:
    """Peers grouped by model load, in catalogue order: (group, peers); a service each."""
    out: dict[str, list[Peer]] = {}
    for peer in peers:
        out.setdefault(peer.key if peer.group == "served" else peer.group, []).append(peer)
    return [(ps[0].group, ps) for ps in out.values()]


@dataclass
class _Started:
    """One unit's runner in a round, and the time it took to load and to measure."""

    runner: object
    peers: list[Peer]
    load_s: float
    measure_s: float = 0.0


def _start(cfg: PeerConfig, group: str, peers: list[Peer], results: dict[str, PeerResult],
           progress, task, where: str, points) -> _Started | None:
    """A unit's runner, or None (its peers skipped with the reason) where it cannot start."""
    progress.advance(task, sum(points(p) for p in peers if results[p.key].skipped))
    peers = [p for p in peers if not results[p.key].skipped]
    if not peers:
        return None
    progress.update(task, description=f"{where}: loading {peers[0].key}")
    t0 = time.perf_counter()
    try:
        runner = (ServedPeer(cfg, peers[0]) if group == "served" else
                  LlamaServerPeer(cfg) if group == "llama-server" else
                  ChildGroup(cfg, group))
    except Exception as exc:  # noqa: BLE001 - a peer that cannot start is skipped
        for p in peers:
            results[p.key].skipped = f"failed to start: {str(exc)[:300]}"
            progress.advance(task, points(p))
        return None
    return _Started(runner, peers, time.perf_counter() - t0)


def _measure(prompts, unit: _Started, p: Peer, c: int, results: dict[str, PeerResult],
             progress, task, where: str) -> None:
    if not applies(p, c):
        return
    progress.update(task, description=f"{where}: {p.key} @ {c}")
    if not results[p.key].skipped:
        t0 = time.perf_counter()
        try:
            point = unit.runner.measure(p.key, c, requests_for(prompts, c))
            results[p.key].points.setdefault(c, []).append(point)
        except Exception as exc:  # noqa: BLE001
            results[p.key].skipped = f"failed: {str(exc)[:300]}"
        unit.measure_s += time.perf_counter() - t0
    progress.advance(task)


def run_device(cfg: PeerConfig, prompts, active: list[Peer], results: dict[str, PeerResult],
               rounds: int, progress, task, timings: list) -> None:
    """Every active peer at every concurrency it applies to, `rounds` times round robin.
    On the CPU a round starts all its peers first, then takes the points concurrency by
    concurrency, peer after peer: a point's peers run seconds apart, not minutes, so the drift
    of a shared machine (10-20% over minutes on a 2-core host) moves them alike. On a GPU one
    peer runs at a time (a service sizes its KV cache by the memory left free). A peer that
    fails is skipped from then on, with the error as its reason."""
    def points(p: Peer) -> int:
        return sum(applies(p, c) for c in cfg.concurrency)

    together = cfg.device == "cpu"
    for rnd in range(rounds):
        where = f"{cfg.device} round {rnd + 1}/{rounds}"
        # Every other round in reverse, started and taken: whatever going first is worth at a
        # point evens out over rounds (two services side by side: the first started read 1-2%
        # faster in both orders, within noise, but a fixed order biases every round alike).
        flip = together and rnd % 2 == 1
        batches = ([units(active)[::-1] if flip else units(active)] if together
                   else [[u] for u in units(active)])
        for batch in batches:
            started: list[_Started] = []
            try:
                for group, peers in batch:
                    if unit := _start(cfg, group, peers, results, progress, task, where, points):
                        started.append(unit)
                order = ([(c, u, p) for c in cfg.concurrency for u in started
                          for p in (u.peers[::-1] if flip else u.peers)]
                         if together else
                         [(c, u, p) for u in started for p in u.peers for c in cfg.concurrency])
                for c, unit, p in order:
                    _measure(prompts, unit, p, c, results, progress, task, where)
            finally:
                for unit in started:
                    unit.runner.close()
            timings += [dict(device=cfg.device, round=rnd + 1,
                             peers=", ".join(p.key for p in u.peers),
                             load_s=u.load_s, measure_s=u.measure_s) for u in started]


def run_bench_peers(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from fmserve.bench.peers_report import machine_description, write_report
    from fmserve.default_model import resolve_model_path
    from service.tokenizer import TextTokenizer

    for module in ("matplotlib", "psutil"):
        if not _importable(module):
            raise RuntimeError(f"fmserve bench peers needs {module}: pip install {module} "
                               "(or install fmserve with its dev extra)")
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not args.temperature and (args.top_k, args.top_p, args.min_p) != (0, 1.0, 0.0):
        raise ValueError("--top-k, --top-p and --min-p cut a sampled draw: give --temperature "
                         "above 0 with them (a greedy run takes the argmax, uncut)")
    if args.temperature and args.top_p == 0.0:
        raise ValueError("--top-p 0 keeps no token: give a number above 0 (1: no cut)")
    reasons = selected_peers(args)  # a bad --peers before minutes of set-up
    if args.draft_model and not any(p.spec in ("chain", "tree") and not reasons[p.key]
                                    for p in PEERS):
        raise ValueError(f"--draft-model {args.draft_model!r} is given but none of the peers "
                         f"that run (--peers {args.peers!r}) decodes speculatively, so it would "
                         f"be ignored: select an EAGLE peer (e.g. --peers 'offline-*chain') to "
                         f"measure it, or drop --draft-model")
    # The speculative shapes that run, their settings checked before any work: only theirs
    # (--spec-num-steps 1 suits a chain, not the default tree).
    spec_names = {p.spec for p in PEERS if not reasons[p.key]} & {"chain", "tree"}
    spec_settings = {name: spec_settings_for(name, args).validate() for name in sorted(spec_names)}
    console = Console()
    load_before = os.getloadavg()
    busy_before = busy_cores(1.0)
    started = time.time()
    model_path = resolve_model_path(args.model)
    prompts = load_prompts(args.prompts, args.num_prompts, args.max_prompt_tokens,
                           TextTokenizer.from_model_path(model_path))
    cuda = torch.cuda.is_available()
    devices = {"auto": ["cpu"] + (["cuda"] if cuda else []), "cpu": ["cpu"],
               "cuda": ["cuda"]}.get(args.device)
    if devices is None:
        raise ValueError(f"--device {args.device!r}: choose auto, cpu or cuda")
    if "cuda" in devices and not cuda:
        raise ValueError("--device cuda: torch sees no CUDA GPU")
    active = [p for p in PEERS if not reasons[p.key]]
    configs = {d: peer_config(args, model_path, d, prompts, spec_settings) for d in devices}
    all_results: dict[str, dict[str, PeerResult]] = {}
    timings: list[dict] = []
    per_round = sum(applies(p, c) for p in active for c in configs[devices[0]].concurrency)
    columns = [TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("bench peers", total=per_round * args.repetitions * len(devices))
        for device in devices:
            results = {p.key: PeerResult(p, skipped=reasons[p.key]) for p in PEERS}
            for p in PEERS:
                for c in configs[device].concurrency:
                    if not applies(p, c):
                        results[p.key].point_skips[c] = NOT_APPLICABLE.get(p.key, "n/a")
            run_device(configs[device], prompts, active, results, args.repetitions, progress,
                       task, timings)
            all_results[device] = results
    meta = dict(
        command="fmserve " + shlex.join(getattr(args, "argv", None) or sys.argv[1:]),
        started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        duration_s=time.time() - started, load_before=load_before, load_after=os.getloadavg(),
        busy_cores_before=busy_before,
        machine=machine_description(), quick=args.quick, note=args.note,
        prompts=args.prompts, num_prompts=args.num_prompts,
        prompt_tokens=[len(p) for p in prompts], max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        cuts=dict(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p),
        repetitions=args.repetitions, threads=args.threads,
        configs={d: vars(c) for d, c in configs.items()}, cuda_available=cuda,
        model=str(model_path), timings=timings)
    path = write_report(Path(args.out_dir), meta, all_results)
    console.print(f"report: {path} ({meta['duration_s']:.0f} s)")
    return 0
