"""`fmserve bench offline`: prefill and decode tokens/s of the offline engine, against
transformers `generate` on the same weights, in the same run.

Prompts are the dev set's prompts, tokenised and cut (or repeated) to exactly --prompt-len
tokens, so both engines see identical inputs. Decoding is greedy with eos ignored, so every
request produces exactly --decode-len tokens.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from fmserve.bench import dev_texts
from fmserve.bench.tables import print_table
from fmserve.bench.transformers_model import load_transformers
from fmserve.default_model import resolve_model_path
from fmserve.engine import Engine
from ipc.worker_config import DEFAULT_Q4_MAX_TOKENS
from ipc.sampling import SamplingParams

FILLER_TEXT = ("The quick brown fox jumps over the lazy dog while the scheduler batches "
                 "requests and the worker decodes tokens. ")


@dataclass
class Measure:
    engine: str
    dtype: str
    batch: int
    prefill_tps: float
    decode_tps: float
    overlap: bool = False
    q4: bool = False  # small forwards on the GGUF's 4-bit codes (gpu/q4_linear.py)
    graphs: bool = False  # decode batches replay CUDA graphs (gpu/decode_graphs.py)


def bench_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    texts = dev_texts()
    prompts = []
    for i in range(n):
        ids = tokenizer.encode(texts[i % len(texts)])
        while len(ids) < length:
            ids = ids + tokenizer.encode(FILLER_TEXT)
        prompts.append(ids[:length])
    return prompts


def measure_fmserve(engine: Engine, prompts: list[list[int]], decode_len: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0.0, max_new_tokens=decode_len, ignore_eos=True)
    # Warm-up at this batch size: on a GPU each new shape may compile kernels first.
    engine.generate([p[:8] for p in prompts], SamplingParams(max_new_tokens=4))
    start = time.perf_counter()
    first_token_done = None
    seen = set()
    for out in engine.stream(prompts, params):
        seen.add(out.rid)
        if first_token_done is None and len(seen) == len(prompts):
            first_token_done = time.perf_counter()
    end = time.perf_counter()
    prefill_tokens = sum(len(p) for p in prompts)
    decode_tokens = len(prompts) * (decode_len - 1)
    return prefill_tokens / (first_token_done - start), decode_tokens / (end - first_token_done)


def measure_transformers(model, prompts: list[list[int]], decode_len: int) -> tuple[float, float]:
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, min_new_tokens=4, **{**kwargs, "attention_mask": mask[:, :8]})
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=decode_len, min_new_tokens=decode_len, **kwargs)
        t_total = time.perf_counter() - t0
    n = len(prompts)
    return n * ids.shape[1] / t_prefill, n * (decode_len - 1) / max(t_total - t_prefill, 1e-9)


def run_bench_offline(args: argparse.Namespace) -> int:
    console = Console()
    path = resolve_model_path(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    dtypes = args.dtypes.split(",")
    overlaps = [o == "on" for o in getattr(args, "overlap", "off").split(",")]
    q4_modes = [o == "on" for o in getattr(args, "q4", "on").split(",")]
    q4_max = getattr(args, "q4_max_tokens", DEFAULT_Q4_MAX_TOKENS)
    graph_modes = [o == "on" for o in getattr(args, "cuda_graphs", "off").split(",")]
    results: list[Measure] = []
    with Progress(console=console) as progress:
        task = progress.add_task("benchmark", total=len(dtypes) * len(batches) * 2)
        for dtype in dtypes:
            engine = Engine(model=str(path), device=args.device, dtype=dtype,
                            attention_backend=args.attention_backend,
                            max_running_requests=max(batches), progress=False,
                            q4_max_tokens=q4_max if any(q4_modes) else 0,
                            cuda_graph_max_batch=max(batches) if any(graph_modes)
                            and args.attention_backend == "triton" else 0)
            has_q4 = engine.worker.state.model.q4_projections > 0
            graphs = engine.worker.step.decode_graphs  # None on a CPU: only "off" runs there
            if any(graph_modes) and graphs is None:
                console.print("[yellow]--cuda-graphs on: no CUDA graphs on this device "
                              "(they need CUDA and --attention-backend triton); measuring "
                              "without[/]")
            all_prompts = bench_prompts(engine.tokenizer, max(batches), args.prompt_len)
            for b in batches:
                # Interleaved per batch size, so drift hits every variant alike.
                for q4 in sorted({q and has_q4 for q in q4_modes}):
                    engine.worker.state.model.set_q4_max_tokens(q4_max if q4 else 0)
                    for graphed in sorted({g and graphs is not None for g in graph_modes}):
                        engine.worker.step.decode_graphs = graphs if graphed else None
                        for overlap in overlaps:
                            progress.update(task, description=f"fmserve {dtype} batch {b}"
                                                              f"{' overlap' if overlap else ''}"
                                                              f"{' q4' if q4 else ''}"
                                                              f"{' graphs' if graphed else ''}")
                            engine.overlap = overlap
                            pf, dc = measure_fmserve(engine, all_prompts[:b], args.decode_len)
                            results.append(Measure("fmserve", dtype, b, pf, dc, overlap, q4,
                                                   graphed))
                progress.advance(task)
            del engine
            if args.no_baseline:
                progress.advance(task, len(batches))
                continue
            hf = load_transformers(path, torch.bfloat16 if dtype == "bf16" else torch.float32)
            for b in batches:
                if b > args.baseline_max_batch:
                    progress.advance(task)
                    continue
                progress.update(task, description=f"transformers {dtype} batch {b}")
                pf, dc = measure_transformers(hf, all_prompts[:b], args.decode_len)
                results.append(Measure("transformers", dtype, b, pf, dc))
                progress.advance(task)
            del hf
    lines = render(results, args, console)
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    return 0


def render(results: list[Measure], args: argparse.Namespace, console: Console) -> list[str]:
    base = {(m.dtype, m.batch): m for m in results if m.engine == "transformers"}
    fm = {(m.dtype, m.batch, m.overlap, m.q4, m.graphs): m for m in results
          if m.engine == "fmserve"}
    header = ["dtype", "batch", "overlap", "q4", "graphs", "fmserve prefill tok/s",
              "fmserve decode tok/s", "transformers prefill tok/s", "transformers decode tok/s",
              "decode ratio", "prefill ratio", "decode overlap on/off", "decode q4 on/off",
              "decode graphs on/off"]
    rows = []
    for m in results:
        if m.engine != "fmserve":
            continue
        b = base.get((m.dtype, m.batch))
        o = fm.get((m.dtype, m.batch, False, m.q4, m.graphs)) if m.overlap else None
        q = fm.get((m.dtype, m.batch, m.overlap, False, m.graphs)) if m.q4 else None
        g = fm.get((m.dtype, m.batch, m.overlap, m.q4, False)) if m.graphs else None
        rows.append([m.dtype, str(m.batch), "on" if m.overlap else "off", "on" if m.q4 else "off",
                     "on" if m.graphs else "off",
                     f"{m.prefill_tps:.0f}",
                     f"{m.decode_tps:.1f}",
                     f"{b.prefill_tps:.0f}" if b else "-", f"{b.decode_tps:.1f}" if b else "-",
                     f"{m.decode_tps / b.decode_tps:.2f}x" if b else "-",
                     f"{m.prefill_tps / b.prefill_tps:.2f}x" if b else "-",
                     f"{m.decode_tps / o.decode_tps:.2f}x" if o else "-",
                     f"{m.decode_tps / q.decode_tps:.2f}x" if q else "-",
                     f"{m.decode_tps / g.decode_tps:.2f}x" if g else "-"])
    return print_table(console, f"offline: prompt {args.prompt_len} tokens, decode "
                                f"{args.decode_len} tokens, threads {torch.get_num_threads()}",
                       header, rows)
