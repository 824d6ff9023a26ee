"""`fmserve bench peers`: figures from the measurements, the markdown report and the plots.

Every figure is a number or says "skipped" with the reason; nothing unmeasured is written as a
zero. Ratios are figure / the baseline's figure (transformers generate, batch 1, same run):
above 1 is better for tokens/s and accept length, worse for latency and memory.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fmserve.bench.tables import fmt, markdown_table, with_ratio
from fmserve.bench.peer_types import BASELINE, LLAMA_INSTALL, LLAMA_SERVER_INSTALL, PeerResult
from fmserve.bench.peers_pairs import pairs_sections

REPORT = "peers.md"


@dataclass
class Figures:
    """One peer at one concurrency, pooled over the rounds."""
    output_tps: float | None  # all output tokens / wall time
    decode_tps: float | None  # per stream: tokens after the first / time after the first
    ttft: list[float]
    itl: list[float]
    peak_rss: int
    gpu_peak: int
    accept_length: float | None
    per_position: list[float]  # share of verify steps accepting draft depth i+1


def figures(points) -> Figures:
    reqs = [r for p in points for r in p.reqs]
    tokens, wall = sum(r.tokens for r in reqs), sum(p.wall for p in points)
    dec_tok = sum(r.tokens - 1 for r in reqs if r.tokens > 1)
    dec_time = sum(r.e2e - r.ttft for r in reqs if r.tokens > 1)
    steps = sum(r.spec_steps for r in reqs)
    accepted = sum(r.spec_accepted for r in reqs)
    depth = max((len(r.per_position) for r in reqs), default=0)
    per_pos = [sum(r.per_position[i] for r in reqs if i < len(r.per_position)) / steps
               for i in range(depth)] if steps else []
    return Figures(tokens / wall if wall > 0 and tokens else None,
                   dec_tok / dec_time if dec_time > 0 else None,
                   [r.ttft for r in reqs], [x for r in reqs for x in r.itl],
                   max((p.peak_rss for p in points), default=0),
                   max((p.gpu_peak for p in points), default=0),
                   (accepted + steps) / steps if steps else None, per_pos)


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# --- machine ------------------------------------------------------------------------------


def machine_description() -> dict:
    import psutil
    import torch
    from gpu.cpu_info import cpu_flag_list, cpu_isa, cpu_model
    cpu, flags = cpu_model(), set(cpu_flag_list())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    if cpu_isa() != "native":
        isa.append(f"(capped: FMSERVE_CPU_ISA={cpu_isa()})")
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for module in ("transformers", "llama_cpp"):
        try:
            versions[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - not installed, or broken
            versions[module] = "not installed"
    out = dict(cpu=cpu, isa=" ".join(isa) or "-", logical_cores=os.cpu_count(),
               usable_cores=len(os.sched_getaffinity(0)),
               memory_gb=round(psutil.virtual_memory().total / 2**30, 1),
               torch_threads=torch.get_num_threads(), os=platform.platform(), versions=versions)
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


# --- markdown -----------------------------------------------------------------------------


def spec_words(spec: dict) -> str:
    """The settings of the speculative shapes whose peers ran."""
    return ", ".join(f"{k} {tuple(v)}" for k, v in sorted(spec.items())) or "none ran"


def sampling_words(temperature: float, cuts: dict | None = None) -> str:
    """How a run sampled: greedy, or its temperature and cuts (`cuts`: top_k, top_p, min_p)."""
    named = [f"{k.replace('_', '-')} {v:g}" for k, v in (cuts or {}).items()
             if v != {"top_k": 0, "top_p": 1.0, "min_p": 0.0}[k]]
    return "greedy" if not temperature else f"sampled at temperature {temperature:g}, " + (
        ", ".join(named) or "no top-k, top-p or min-p cut")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [*markdown_table(header, rows), ""]


def device_section(device: str, cfg: dict, results: dict[str, PeerResult], plots: dict,
                   meta: dict) -> list[str]:
    conc = cfg["concurrency"]
    figs = {k: {c: figures(pts) for c, pts in r.points.items()} for k, r in results.items()}
    base = figs.get(BASELINE, {}).get(1)
    ran = [r for r in results.values() if not r.skipped and r.points]
    title = "CPU" if device == "cpu" else f"GPU ({meta['machine'].get('gpu', device)})"
    lines = [f"## {title}", "",
             f"dtype {cfg['dtype']} (fmserve's peers: --dtype {cfg.get('fmserve_dtype', 'auto')}), "
             f"attention backend {cfg['attention_backend']}, "
             f"KV cache of the fmserve peers {cfg['max_kv_tokens']} tokens. "
             f"Baseline: {results[BASELINE].peer.label}"
             + ("" if base else " — **it did not run, so every ratio is skipped**") + ".", ""]

    def cell(key: str, c: int, attr: str, base_value, digits=1) -> str:
        r = results[key]
        if r.skipped:
            return "skipped"
        if c in r.point_skips:
            return "skipped (n/a)"
        f = figs[key].get(c)
        return with_ratio(getattr(f, attr) if f else None, base_value, digits)

    lines += ["### Throughput and memory", "",
              "Decode tok/s: one stream at batch 1, tokens after the first over the time after "
              "the first. Output tok/s at C: every output token over the wall time of the point "
              "(prefill included), C streams in a closed loop. Ratios against the baseline's "
              "batch-1 figure (its output tok/s for every C: serving C streams one at a time). "
              "Peak RSS: the most resident memory of the process (tree) running the peer, sampled "
              "every 20 ms while it was measured (the model load's own transient peak is not "
              "included); peers sharing a model load share a process.", ""]
    header = ["peer", "decode tok/s @1"] + [f"output tok/s @{c}" for c in conc] + \
             ["peak RSS MB", "mean accept length"]
    if device != "cpu":
        header.insert(-1, "GPU peak MB")
    rows = []
    for key, r in results.items():
        row = [r.peer.label + f" (`{key}`)", cell(key, 1, "decode_tps", base and base.decode_tps)]
        row += [cell(key, c, "output_tps", base and base.output_tps) for c in conc]
        if r.skipped:
            row += ["skipped"] * (len(header) - len(row))
            rows.append(row)
            continue
        rss = max((f.peak_rss for f in figs[key].values()), default=0) / 2**20
        row.append(with_ratio(rss or None, base and base.peak_rss / 2**20, 0))
        if device != "cpu":
            gpu = max((f.gpu_peak for f in figs[key].values()), default=0) / 2**20
            row.append(fmt(gpu or None, 0, "not measured: a service runs in its own processes"
                           if r.peer.group == "served" else "no data"))
        first = figs[key][min(figs[key])] if figs[key] else None
        row.append(fmt(first.accept_length, 2, "no speculation") if first else "skipped")
        rows.append(row)
    lines += table(header, rows)
    lines += pairs_sections(results)

    lines += ["### Latency", "",
              "Milliseconds, from submission (served: from the client's send). TTFT: to the "
              "first token; ITL: between tokens (a chunk of k tokens g ms after the previous "
              "one counts k gaps of g/k). Ratios against the baseline's batch-1 figure; lower "
              "is better.", ""]
    header = ["peer", "C", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    rows = []
    b = {q: None for q in ("t50", "t99", "i50", "i99")}
    if base:
        b = dict(t50=pct(base.ttft, 50), t99=pct(base.ttft, 99), i50=pct(base.itl, 50),
                 i99=pct(base.itl, 99))
    for r in ran:
        for c, f in sorted(figs[r.peer.key].items()):
            ms = lambda v: None if v is None else v * 1000  # noqa: E731
            rows.append([f"`{r.peer.key}`", str(c),
                         with_ratio(ms(pct(f.ttft, 50)), ms(b["t50"]), 0),
                         with_ratio(ms(pct(f.ttft, 99)), ms(b["t99"]), 0),
                         with_ratio(ms(pct(f.itl, 50)), ms(b["i50"]), 1),
                         with_ratio(ms(pct(f.itl, 99)), ms(b["i99"]), 1)])
    lines += table(header, rows)

    spec = [r for r in ran if any(f.accept_length is not None for f in figs[r.peer.key].values())]
    lines += ["### Speculation", "",
              "Mean accept length: tokens per verify step (accepted drafts + the bonus token). "
              "Per position: the share of verify steps that accepted the draft at depth i. "
              "Prompt lookup: output tokens per target forward (transformers reports no "
              "per-position figures). Speculation settings (algorithm, head, steps, topk, draft "
              f"tokens): {spec_words(cfg['spec'])} "
              "(an empty head = the shipped head of the default model).", ""]
    rows = []
    for r in spec:
        for c, f in sorted(figs[r.peer.key].items()):
            rows.append([f"`{r.peer.key}`", str(c), fmt(f.accept_length, 2, "no verify steps"),
                         " ".join(f"{x:.2f}" for x in f.per_position) or "skipped (not reported)"])
    lines += table(["peer", "C", "mean accept length", "acceptance per position"], rows) \
        if rows else ["No speculative peer ran.", ""]

    lines += ["### Skipped", ""]
    rows = [[f"`{r.peer.key}`", "all", r.skipped] for r in results.values() if r.skipped]
    rows += [[f"`{r.peer.key}`", str(c), why] for r in results.values() if not r.skipped
             for c, why in r.point_skips.items()]
    lines += table(["peer", "C", "why"], rows) if rows else ["Nothing was skipped.", ""]
    lines += ["### Plots", ""] + [f"![{name}]({file})" for name, file in plots.items()] + [""]
    return lines


def render(meta: dict, all_results: dict, plots: dict) -> str:
    m = meta["machine"]
    cfg0 = next(iter(meta["configs"].values()), {})
    load = (f"load average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in meta['load_before'])} "
            f"before, {'/'.join(f'{x:.1f}' for x in meta['load_after'])} after")
    busy = meta.get("busy_cores_before")
    if busy is not None:  # what others ran as it started; the load average lags a minute
        load = f"{busy:.1f} cores busy with other work as it started; {load}"
    contended = busy >= 0.5 if busy is not None else meta["load_before"][0] >= 1.0
    lines = ["# fmserve against its peers (`fmserve bench peers`)", "",
             f"Written by `fmserve bench peers` on {meta['started']} in "
             f"{meta['duration_s']:.0f} s ({'--quick' if meta['quick'] else 'full'} mode). "
             "Regenerate it with the command below; it overwrites this file and its plots.", "",
             "```", meta["command"], "```", ""]
    if contended:
        lines += [f"**Contended run:** other work was running on this machine ({load}); "
                  "figures are lower and noisier than on a quiet machine. Compare ratios "
                  "within this run, not absolute figures across runs. On a small machine a busy "
                  "neighbour stalls every multi-threaded OpenMP op at its barriers, so peers "
                  "running fewer threads (a served worker with overlap gets cores - 1) can look "
                  "far better than they are; `--threads 1` gives every peer the same footing.",
                  ""]
    if meta["note"]:
        lines += [f"Note: {meta['note']}", ""]
    v = m["versions"]
    lines += ["## Machine and settings", "",
              f"- CPU: {m['cpu']} ({m['isa']}); {m['logical_cores']} logical cores, "
              f"{m['usable_cores']} usable; {m['memory_gb']} GB memory; "
              f"{m.get('gpu', 'no CUDA GPU')}",
              f"- {m['os']}; python {v['python']}, torch {v['torch']} "
              f"({m['torch_threads']} threads), transformers {v['transformers']}, "
              f"llama-cpp-python {v['llama_cpp']}",
              f"- {load}",
              f"- model: `{Path(meta['model']).name}` (every peer loads this GGUF)",
              f"- prompts: {meta['num_prompts']} from `{Path(meta['prompts']).name}`, cut to "
              f"{meta['max_prompt_tokens']} text tokens, chat template applied: "
              f"{min(meta['prompt_tokens'])}-{max(meta['prompt_tokens'])} prompt tokens; "
              f"{sampling_words(meta.get('temperature', 0.0), meta.get('cuts'))}, exactly "
              f"{meta['max_new_tokens']} new tokens (eos ignored)",
              f"- {meta['repetitions']} round(s), round robin over the peers (on the CPU all of "
              "a round's peers are started first and each concurrency is taken peer after "
              "peer, every other round in reverse order); at C = 1 each prompt runs once per "
              "round; at C > 1, whole waves of C requests (prompts cycled)",
              (f"- every peer runs {meta['threads']} torch thread(s) (--threads)"
               if meta["threads"] else
               "- threads: in-process peers use torch's default; fmserve served peers the "
               "service's own rule (with overlap a CPU worker leaves one core to the "
               "scheduler)"),
              f"- llama.cpp (neither is a dependency of fmserve): the Python API with "
              f"`{LLAMA_INSTALL}`; the server: {LLAMA_SERVER_INSTALL}"
              + (f" (this run: `{cfg0['llama_server']}`)" if cfg0.get("llama_server") else ""),
              ""]
    for device, results in all_results.items():
        cfg = meta["configs"][device]
        lines += device_section(device, cfg, results, plots.get(device, {}), meta)
    if "cuda" not in all_results:
        lines += ["## GPU", "", "skipped: torch.cuda.is_available() is False on this machine "
                  "(the same command adds this section on a machine with a CUDA GPU).", ""]
    if meta.get("timings"):
        lines += ["## Where the time went", "",
                  "Seconds per model load (a child process, or a service with its worker) and "
                  "per measurement of the peers it served.", ""]
        lines += table(["device", "round", "peers", "load s", "measure s"],
                       [[t["device"], str(t["round"]), t["peers"], f"{t['load_s']:.1f}",
                         f"{t['measure_s']:.1f}"] for t in meta["timings"]])
    return "\n".join(lines)


# --- plots --------------------------------------------------------------------------------


def _styles(keys: list[str]) -> dict[str, dict]:
    """A colour per peer (tab20), a line style per family: transformers/llama.cpp dashed,
    offline solid, served dash-dot."""
    import matplotlib
    cmap = matplotlib.colormaps["tab20"]
    out = {}
    for i, key in enumerate(keys):
        ls = "-" if key.startswith("offline") else "-." if key.startswith("served") else "--"
        out[key] = dict(color=cmap(i % 20), linestyle=ls, label=key)
    return out


def make_plots(out_dir: Path, device: str, cfg: dict, results: dict[str, PeerResult]) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator
    suffix = "" if device == "cpu" else f"_{device}"
    figs = {k: {c: figures(pts) for c, pts in r.points.items()}
            for k, r in results.items() if not r.skipped and r.points}
    files = {}
    style = _styles(list(figs))

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key, by_c in figs.items():
        xs = sorted(c for c in by_c if by_c[c].output_tps)
        if xs:
            ax.plot(xs, [by_c[c].output_tps for c in xs], marker="o", **style[key])
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(cfg["concurrency"]))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(c) for c in cfg["concurrency"]])
    values = [f.output_tps for by_c in figs.values() for f in by_c.values() if f.output_tps]
    if values and max(values) > 20 * min(values):
        ax.set_yscale("log")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"throughput vs concurrency ({device}, {cfg['dtype']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    files["throughput vs concurrency"] = _save(fig, out_dir, f"peers_throughput{suffix}.png")

    levels = sorted({1, max(cfg["concurrency"])})
    fig, axes = plt.subplots(len(levels), 2, figsize=(11, 4 * len(levels)), squeeze=False)
    for row, c in enumerate(levels):
        for col, (what, attr) in enumerate((("TTFT", "ttft"), ("ITL", "itl"))):
            ax = axes[row][col]
            for key, by_c in figs.items():
                values = np.sort(np.asarray(getattr(by_c[c], attr))) * 1000 if c in by_c else []
                if len(values):
                    ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                            **style[key])
            ax.set_xscale("log")
            ax.set_xlabel(f"{what} ms")
            ax.set_ylabel("fraction of requests" if attr == "ttft" else "fraction of tokens")
            ax.set_title(f"{what} CDF at {c} stream(s)")
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=6)
    files["latency CDFs"] = _save(fig, out_dir, f"peers_latency_cdf{suffix}.png")

    fig, ax = plt.subplots(figsize=(8, 5))
    for key in figs:  # pooled over every concurrency the peer ran at
        f = figures([p for pts in results[key].points.values() for p in pts])
        if f.per_position:
            ax.plot(range(1, len(f.per_position) + 1), f.per_position, marker="o",
                    **{**style[key], "label": f"{key} (mean accept length "
                                              f"{f.accept_length:.2f})"})
            ax.set_xticks(range(1, len(f.per_position) + 1))
    if not ax.has_data():
        ax.text(0.5, 0.5, "no speculative peer ran", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_xlabel("draft position (depth)")
    ax.set_ylabel("share of verify steps accepting it")
    ax.set_ylim(0, 1)
    ax.set_title(f"EAGLE acceptance per position ({device})")
    ax.grid(alpha=0.3)
    if ax.has_data() and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    files["accept length per position"] = _save(fig, out_dir, f"peers_accept{suffix}.png")
    return files


def _save(fig, out_dir: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return name


def write_report(out_dir: Path, meta: dict, all_results: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {d: make_plots(out_dir, d, meta["configs"][d], res) for d, res in all_results.items()}
    path = out_dir / REPORT
    path.write_text(render(meta, all_results, plots) + "\n", encoding="utf-8")
    raw = {d: {k: dict(skipped=r.skipped, point_skips=r.point_skips,
                       figures={c: _raw(figures(p)) for c, p in r.points.items()})
               for k, r in res.items()} for d, res in all_results.items()}
    (out_dir / "peers.json").write_text(json.dumps(dict(meta=meta, results=raw), indent=1,
                                                   default=str) + "\n", encoding="utf-8")
    return path


def _raw(f: Figures) -> dict:
    return dict(output_tps=f.output_tps, decode_tps=f.decode_tps,
                ttft_p50=pct(f.ttft, 50), ttft_p99=pct(f.ttft, 99), itl_p50=pct(f.itl, 50),
                itl_p99=pct(f.itl, 99), peak_rss=f.peak_rss, gpu_peak=f.gpu_peak,
                accept_length=f.accept_length, per_position=f.per_position)
