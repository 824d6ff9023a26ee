"""`fmserve bench offline --spec chain,tree`: EAGLE speculative decoding against the plain
engine, in the same run, on the dev prompts (chat template, greedy, natural stops).

For each batch size the same prompts run through the non-speculative engine and through each
speculative setting; reported are decode tokens/s (output tokens after every request of a
group has its first token, over the time since), the ratio to the plain engine, the mean
accept length (tokens per verify step: accepted drafts + the bonus token) and the acceptance
rate per draft position, both counting emitted tokens only (a step cut short by a stop or
--max-new-tokens counts the drafts it kept). Greedy outputs are also compared token for token.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import Progress

from fmserve.arg_types import batch_limit, positive_int
from fmserve.bench import DEV_PROMPTS
from fmserve.bench.tables import print_table
from fmserve.jsonl import read_prompts
from ipc.worker_config import DEFAULT_Q4_MAX_TOKENS
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings, accept_length

if TYPE_CHECKING:  # torch: imported when the bench runs, not by every `fmserve` command
    from fmserve.engine import Engine


@dataclass
class SpecRun:
    name: str
    batch: int
    decode_tps: float
    output_tokens: int
    verify_steps: int = 0
    accepted: int = 0
    per_position: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def accept_length(self) -> float | None:
        return accept_length(self.accepted, self.verify_steps)


def add_bench_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (with --spec)")
    g.add_argument("--spec", default=None,
                   help="compare speculative settings against the plain engine: chain, tree or "
                        "chain,tree (runs on the dev prompts instead of the throughput sweep)")
    g.add_argument("--spec-algorithm", default="eagle3", choices=["eagle3", "eagle"])
    g.add_argument("--draft-model", default="", help="EAGLE head directory (default: the "
                                                     "shipped head of the default model)")
    g.add_argument("--spec-num-steps", type=int, default=4)
    g.add_argument("--tree-topk", type=int, default=4)
    g.add_argument("--tree-draft-tokens", type=int, default=8)
    g.add_argument("--spec-disable-above-batch-size", type=batch_limit, default="auto",
                   help="decode batches larger than this run without drafting (0: never; "
                        "auto: where measured faster)")
    g.add_argument("--num-prompts", type=positive_int, default=16,
                   help="dev prompts per batch size")
    g.add_argument("--max-new-tokens", type=positive_int, default=128)
    g.add_argument("--prompts", default=str(DEV_PROMPTS), help="JSONL with a 'prompt' field")
    g.add_argument("--spec-dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="dtype of both engines (auto: bf16 where the device computes it natively)")


def spec_settings_for(name: str, args: argparse.Namespace) -> SpecSettings:
    steps = args.spec_num_steps
    # (`bench peers` shares these settings but always drafts: it has no such flag.)
    limit = getattr(args, "spec_disable_above_batch_size", 0)
    if name == "chain":
        return SpecSettings(args.spec_algorithm, args.draft_model, steps, 1, steps + 1, limit)
    if name == "tree":
        return SpecSettings(args.spec_algorithm, args.draft_model, steps, args.tree_topk,
                            args.tree_draft_tokens, limit)
    raise ValueError(f"--spec {name!r}: choose chain, tree or chain,tree")


def load_chats(path: str, n: int) -> list[list[dict]]:
    rows = read_prompts(path)
    return [[{"role": "user", "content": rows[i % len(rows)]}] for i in range(n)]


def measure(engine: Engine, name: str, chats: list, batch: int, max_new: int) -> SpecRun:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    engine.generate([chats[0]], SamplingParams(max_new_tokens=4))  # warm-up
    run = SpecRun(name, batch, 0.0, 0)
    per_position: list[int] = []  # verify steps whose emitted tokens include draft depth i+1
    decode_time, decode_tokens = 0.0, 0
    for g in range(0, len(chats), batch):
        group = chats[g:g + batch]
        submitted = engine.submit(group, params)
        tokens = {rid: [] for rid, _ in submitted}
        start_decode = None
        for out in engine.run():
            tokens[out.rid] += out.token_ids
            if start_decode is None and all(tokens.values()):
                start_decode = time.perf_counter()
            if out.finished:
                run.verify_steps += out.spec_verify_steps
                run.accepted += out.spec_accepted_drafts
                count = out.spec_accepted_per_position
                per_position = [a + b for a, b in zip_longest(per_position, count, fillvalue=0)]
        decode_time += time.perf_counter() - start_decode
        produced = sum(len(t) for t in tokens.values())
        decode_tokens += produced - len(group)
        run.output_tokens += produced
        run.outputs += [tokens[rid] for rid, _ in submitted]
    if run.verify_steps:
        run.per_position = [n / run.verify_steps for n in per_position]
    run.decode_tps = decode_tokens / max(decode_time, 1e-9)
    return run


def run_bench_spec(args: argparse.Namespace) -> int:
    console = Console()
    names = [n.strip() for n in args.spec.split(",") if n.strip()]
    settings = {n: spec_settings_for(n, args).validate() for n in names}
    batches = [int(b) for b in args.batch_sizes.split(",")]
    chats = load_chats(args.prompts, args.num_prompts)
    runs: list[SpecRun] = []
    common = dict(model=args.model, device=args.device, dtype=args.spec_dtype,
                  attention_backend=args.attention_backend, progress=False,
                  max_running_requests=max(batches),
                  q4_max_tokens=getattr(args, "q4_max_tokens", DEFAULT_Q4_MAX_TOKENS)
                  if getattr(args, "q4", "on") != "off" else 0)
    with Progress(console=console) as progress:
        task = progress.add_task("spec benchmark", total=(1 + len(names)) * len(batches))
        from fmserve.engine import Engine  # noqa: F811 - torch loads under the progress bar

        for name, spec in [("plain", None)] + list(settings.items()):
            engine = Engine(**common, spec=spec)
            for b in batches:
                progress.update(task, description=f"{name} batch {b}")
                runs.append(measure(engine, name, chats, b, args.max_new_tokens))
                progress.advance(task)
            del engine
    lines = render(runs, args, settings, console)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


def render(runs: list[SpecRun], args, settings: dict, console: Console) -> list[str]:
    import torch

    plain = {r.batch: r for r in runs if r.name == "plain"}
    title = (f"speculative decoding on {args.num_prompts} dev prompts, greedy, up to "
             f"{args.max_new_tokens} new tokens, dtype {args.spec_dtype}, threads "
             f"{torch.get_num_threads()}; "
             + "; ".join(f"{n}: steps {s.num_steps} topk {s.topk} tokens {s.num_draft_tokens}"
                         for n, s in settings.items()))
    header = ["setting", "batch", "decode tok/s", "vs plain", "mean accept length",
              "acceptance per position", "same output as plain"]
    rows = []
    for r in runs:
        base = plain[r.batch]
        same = sum(a == b for a, b in zip(r.outputs, base.outputs))
        rows.append([r.name, str(r.batch), f"{r.decode_tps:.1f}",
                     f"{r.decode_tps / base.decode_tps:.2f}x",
                     "-" if r.accept_length is None else f"{r.accept_length:.2f}",
                     " ".join(f"{p:.2f}" for p in r.per_position) or "-",
                     f"{same}/{len(base.outputs)}"])
    return [title, "", *print_table(console, title, header, rows)]
