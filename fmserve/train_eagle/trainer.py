"""The training loop: batches, AdamW with warmup + cosine, checkpoints, --resume, the shipped head
(built in head.py; batches and schedule in schedule.py; checkpoints in checkpoints.py).

The head starts from ``random_draft_head`` (HF init) with the draft vocabulary of the responses'
most frequent tokens.

Every ``save_every`` steps a checkpoint (head, optimizer, scheduler, step, data position, RNG)
goes to ``<work-dir>/checkpoints`` (the last few kept) and the head in its shipping form (HF-style
directory, fp16 by default) to ``--out``, so a run cut short still leaves a usable head.

``device`` cuda: the head, its optimizer state and the batches live on the GPU, and the forward
runs under bf16 autocast over fp32 master weights (the loss and the teacher's distribution in
fp32). Checkpoints and the shipped head hold CPU tensors either way, so a run started on one
device resumes on the other. On the CPU the numerics are plain fp32, as they always were.
"""

from __future__ import annotations

import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from fmserve.train_eagle.checkpoints import latest_checkpoint, save_checkpoint, to_cpu
from fmserve.train_eagle.data import device_label, log
from fmserve.train_eagle.evaluate import estimate_accept_length
from fmserve.train_eagle.head import (build_head, draft_embed, init_from_head, load_target,
                                      ship_head, vocab_counts_with_prior)
from fmserve.train_eagle.schedule import Schedule, default_warmup, epoch_batches
from fmserve.train_eagle.shards import CapturedData, load_datasets, response_token_counts
from fmserve.train_eagle.ttt import collate, expected_accept_length, ttt_forward

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
CHECKPOINT_DIR = "checkpoints"


@dataclass
class TrainConfig:
    data_dir: str
    ckpt_dir: str
    out: str
    ttt_steps: int = 4
    draft_vocab_size: int = 8192
    head_intermediate_size: int = 0  # the head's MLP width; 0 = the target's (or --init-head's)
    lr: float = 1e-3
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    epochs: float = 2.0
    max_steps: int | None = None
    max_minutes: float | None = None  # fit the schedule to this much wall time (from here)
    max_batch_tokens: int = 2048
    max_train_sequences: int | None = None
    val_sequences: int = 0  # held out (the last N captured) to pick the head that ships
    save_every: int = 50
    log_every: int = 10
    keep_checkpoints: int = 2
    resume: bool = False
    ship_dtype: str = "fp16"
    seed: int = 0
    decay: float = 0.8
    prompt_loss_weight: float = 0.0  # > 0: also train chains rooted in the prompt
    vocab_prior: str | None = None  # JSONL whose prompts/references refine the draft vocabulary
    init_head: str | None = None  # a head directory to start from (its weights and vocabulary)
    refresh_vocab: bool = False  # with init_head: count the draft vocabulary on this run's data
    extra_data: tuple[str, ...] = ()  # more data directories, trained on before data_dir's
    device: str = "cpu"  # "cpu", "cuda" (bf16 autocast, fp32 master weights) or "auto"
    precision: str = "auto"  # "bf16": autocast over fp32 master weights; auto: bf16 on a GPU

    @classmethod
    def from_args(cls, args, work_dir: Path, out: Path) -> "TrainConfig":
        """The fields named as their flags come from `args` where it has them."""
        same = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**same, "data_dir": str(work_dir / "data"),
                      "ckpt_dir": str(work_dir / CHECKPOINT_DIR), "out": str(out),
                      "decay": getattr(args, "step_loss_decay", 0.8),
                      "vocab_prior": None if args.no_vocab_prior else args.prompts,
                      "init_head": getattr(args, "init_head", None) or None,
                      "refresh_vocab": bool(getattr(args, "refresh_vocab", False)),
                      "extra_data": tuple(getattr(args, "extra_data", None) or ())})


# -- the loop -----------------------------------------------------------------------------------

CALIBRATION_STEPS = 8  # steps timed before a --max-minutes budget fixes the schedule


@dataclass
class TrainResult:
    out: Path
    steps: int
    history: list[tuple[int, float, list[float]]]  # (step, loss, per-step accuracy) per step


def uses_bf16(device: torch.device, precision: str) -> bool:
    """auto: bf16 on a GPU; on a CPU plain fp32 (bf16 pays only where the cores have bf16
    matrix units, AMX say: 1.4x on the 2-core Xeon, so it is asked for there)."""
    return device.type == "cuda" if precision == "auto" else precision == "bf16"


def autocast_for(device: torch.device, precision: str = "auto"):
    """bf16 autocast over fp32 master weights, or nothing (plain fp32)."""
    if uses_bf16(device, precision):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def precision_label(device: torch.device, precision: str) -> str:
    return "bf16 autocast, fp32 master weights" if uses_bf16(device, precision) else "fp32"


def train(cfg: TrainConfig, model_path: Path, governor=None, progress: bool = True,
          data: CapturedData | None = None, target=None) -> TrainResult:
    """Train (or resume) and write the head to cfg.out. ``target``: load_target's result, when
    the caller has it already."""
    from tqdm import tqdm

    from gpu.device import resolve_device

    if cfg.refresh_vocab and not cfg.init_head:
        raise SystemExit("train-eagle: --refresh-vocab re-counts the vocabulary of the head given "
                         "by --init-head; give --init-head too (a fresh head always counts it)")
    device = resolve_device(cfg.device)
    where = device_label(device)
    torch.manual_seed(cfg.seed)
    ckpt_dir = Path(cfg.ckpt_dir).expanduser()
    out = Path(cfg.out).expanduser()
    resume_from = latest_checkpoint(ckpt_dir) if ckpt_dir.exists() else None
    if resume_from is not None and not cfg.resume:
        raise SystemExit(f"train-eagle: {ckpt_dir} already holds checkpoints; pass --resume to "
                         f"continue from {resume_from.name}, or delete them to start over")
    if resume_from is None and cfg.resume:  # allowed (a first run can be restarted as is)
        print(f"train-eagle: --resume, but {ckpt_dir} holds no checkpoint: starting from "
              f"scratch", file=sys.stderr, flush=True)

    model_cfg, embed, lm_head, final_norm = target if target is not None else \
        load_target(model_path)
    if lm_head is not embed:
        raise SystemExit("train-eagle: only targets with tied embeddings are supported for now")
    if data is None:
        data = load_datasets([*cfg.extra_data, cfg.data_dir], cfg.max_train_sequences)
    response_counts = counts = response_token_counts(data, model_cfg.vocab_size)
    if cfg.vocab_prior:
        counts = vocab_counts_with_prior(counts, cfg.vocab_prior, model_path)
    width = cfg.head_intermediate_size
    if cfg.init_head and not width:  # fine-tuning keeps the trained head's MLP width
        from gpu.eagle.head_config import read_head_config
        width = int(read_head_config(cfg.init_head).get("intermediate_size") or 0)
    head = build_head(model_cfg, embed, final_norm, counts, cfg.draft_vocab_size, cfg.seed,
                      intermediate_size=width)
    if cfg.init_head:
        init_from_head(head, cfg.init_head, model_cfg, embed, cfg.refresh_vocab)
    coverage = float(response_counts[head.t2d].sum() / response_counts.sum().clamp(min=1))
    head.to(device)  # built on the CPU (the same init anywhere), trained here
    n_val = min(cfg.val_sequences, len(data) // 5)
    train_ids = list(range(len(data) - n_val))
    val_ids = list(range(len(data) - n_val, len(data)))
    lengths = [data.length(j) for j in train_ids]
    per_epoch = len(epoch_batches(lengths, cfg.max_batch_tokens, cfg.seed, 0))
    total_steps = max(1, math.ceil(cfg.epochs * per_epoch))
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    schedule = Schedule(total_steps, cfg.warmup_steps if cfg.warmup_steps is not None
                        else default_warmup(total_steps), cfg.min_lr_ratio)

    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    fresh_warmup = schedule.warmup
    step, epoch, pos_in_epoch = 0, 0, 0
    best = {"accept": -1.0, "step": 0, "acc": []}  # the validation score of the shipped head
    if resume_from is not None:
        # CPU tensors (also from a checkpoint a GPU run wrote); the optimizer's load_state_dict
        # moves its state to the parameters' device.
        state = torch.load(resume_from, map_location="cpu", weights_only=False)
        for key in ("ttt_steps", "draft_vocab_size", "head_intermediate_size"):
            if state["config"].get(key, 0) != getattr(cfg, key):
                raise SystemExit(f"train-eagle: {resume_from.name} was trained with {key}="
                                 f"{state['config'].get(key, 0)}, now {getattr(cfg, key)}: "
                                 f"give the same value to --resume")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, epoch, pos_in_epoch = state["step"], state["epoch"], state["pos_in_epoch"]
        best = state.get("best", best)
        # (LambdaLR's state carries the Schedule's fields: set them as this run wants.)
        if cfg.max_steps is None and cfg.max_minutes is None and "schedule" in state:
            # The schedule the run was started with (a time budget fixed it then).
            schedule.total_steps, schedule.warmup = state["schedule"]
        else:
            schedule.total_steps, schedule.warmup = total_steps, fresh_warmup
        total_steps = schedule.total_steps
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        log(f"resumed from {resume_from} (step {step}, epoch {epoch}, batch {pos_in_epoch})")
    dembed = draft_embed(head, embed)
    head.train()

    n_params = sum(p.numel() for p in params)
    train_tokens = sum(lengths)
    train_response = sum(lengths[i] - data.prompt_len[j] for i, j in enumerate(train_ids))
    log(f"train: {len(train_ids)} sequences (+{n_val} held out), {train_tokens} tokens "
        f"({train_response} response), {per_epoch} batches/epoch of <= "
        f"{cfg.max_batch_tokens} tokens; "
        f"{total_steps} steps (warmup {schedule.warmup})"
        + (f" or what fits {cfg.max_minutes:g} min" if cfg.max_minutes else "")
        + f", lr {cfg.lr}, TTT {cfg.ttt_steps} steps; "
        f"draft vocab {head.config.draft_vocab_size} covers {coverage:.1%} of response tokens; "
        f"{n_params / 1e6:.1f}M trainable parameters; on {where}"
        + f" ({precision_label(device, cfg.precision)})")

    def record(acc: list[float]) -> dict:
        return {"step": step, "total_steps": total_steps, "sequences": len(data),
                "tokens": data.num_tokens, "ttt_steps": cfg.ttt_steps,
                "step_loss_decay": cfg.decay,
                "draft_vocab_size": head.config.draft_vocab_size,
                "draft_vocab_coverage": round(coverage, 4),
                "head_intermediate_size": head.config.intermediate_size,
                "train_acc_per_position": [round(a, 4) for a in acc],
                "train_est_accept_length": round(expected_accept_length(acc), 3),
                "device": device.type,
                **({"init_head": cfg.init_head} if cfg.init_head else {}),
                **({"refresh_vocab": True} if cfg.init_head and cfg.refresh_vocab else {}),
                **({"extra_data": list(cfg.extra_data)} if cfg.extra_data else {}),
                **({"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}),
                "precision": precision_label(device, cfg.precision),
                **({"val_sequences": n_val, "val_acc_per_position": [round(a, 4) for a in
                                                                     best["acc"]],
                    "val_est_accept_length": round(best["accept"], 3)} if n_val else {})}

    def checkpoint(acc: list[float]) -> None:
        ship = True
        if n_val:
            val_accept, val_acc, _ = estimate_accept_length(head, data, embed, K, seqs=val_ids,
                                                            draft_embed_=dembed)
            head.train()
            ship = val_accept >= best["accept"]
            log(f"validation ({n_val} held-out sequences): est. accept length {val_accept:.3f}, "
                f"acc " + " ".join(f"{a:.3f}" for a in val_acc)
                + (" (best so far: shipping)" if ship else
                   f" (best {best['accept']:.3f} at step {best['step']}: not shipped)"))
            if ship:
                best.update(accept=val_accept, step=step, acc=val_acc)
        state = {"step": step, "epoch": epoch, "pos_in_epoch": pos_in_epoch, "best": best,
                 "head": to_cpu(head.state_dict()), "optimizer": to_cpu(opt.state_dict()),
                 "scheduler": sched.state_dict(), "config": asdict(cfg),
                 "schedule": (schedule.total_steps, schedule.warmup),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        path = save_checkpoint(ckpt_dir, state, cfg.keep_checkpoints)
        if ship:
            ship_head(head, out, DTYPES[cfg.ship_dtype], record(acc))
        log(f"checkpoint {path.name}" + (f"; head written to {out}" if ship else ""))

    step_cap = total_steps  # what --epochs / --max-steps allow

    def fit_time_budget(margin: float) -> None:
        """Set total_steps to what fits the rest of --max-minutes at the speed so far."""
        nonlocal total_steps
        elapsed = time.perf_counter() - t_start
        rate = (step - start_step) / elapsed
        fit = step + int(rate * (cfg.max_minutes * 60 - elapsed) * margin)
        fit = max(step + 1, min(step_cap, fit))
        if abs(fit - total_steps) <= 0.01 * total_steps:
            return
        total_steps = schedule.total_steps = fit
        if cfg.warmup_steps is None:
            schedule.warmup = min(schedule.warmup, default_warmup(total_steps))
        bar.total = total_steps
        bar.refresh()
        log(f"time budget {cfg.max_minutes:g} min at {rate:.3f} steps/s: {total_steps} steps "
            f"(warmup {schedule.warmup})")

    # A bar on a terminal; in a log file the periodic lines say the same.
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step",
               disable=not progress or not sys.stderr.isatty(), dynamic_ncols=True)
    K = cfg.ttt_steps
    win = {"loss": 0.0, "n": 0, "correct": [0] * K, "count": [0] * K, "tokens": 0,
           "t0": time.perf_counter(), "steps": 0}
    last_acc: list[float] = [0.0] * K
    t_start, start_step = time.perf_counter(), step
    history: list[tuple[int, float, list[float]]] = []
    while step < total_steps:
        batches = epoch_batches(lengths, cfg.max_batch_tokens, cfg.seed, epoch)
        while pos_in_epoch < len(batches) and step < total_steps:
            if governor is not None and step % 10 == 0:
                governor.update()
            batch = collate(data, [train_ids[p] for p in batches[pos_in_epoch]], device)
            with autocast_for(device, cfg.precision):
                stats = ttt_forward(head, batch, dembed, K, cfg.decay,
                                    prompt_weight=cfg.prompt_loss_weight)
            opt.zero_grad(set_to_none=True)
            stats.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            pos_in_epoch += 1
            if cfg.max_minutes and step - start_step == CALIBRATION_STEPS:
                fit_time_budget(0.95)
            loss = float(stats.loss.detach())  # one host sync a step
            win["loss"] += loss
            win["n"] += 1
            win["tokens"] += batch.num_tokens
            for k in range(len(stats.counts)):
                win["correct"][k] += stats.correct[k]
                win["count"][k] += stats.counts[k]
            acc_now = [c / max(1, n) for c, n in zip(stats.correct, stats.counts)]
            history.append((step, loss, acc_now))
            bar.set_postfix_str(f"loss {loss:.3f} acc "
                                + "/".join(f"{a:.2f}" for a in acc_now), refresh=False)
            bar.update(1)
            if step % cfg.log_every == 0 or step == total_steps:
                dt = time.perf_counter() - win["t0"]
                last_acc = [c / max(1, n) for c, n in zip(win["correct"], win["count"])]
                done = step - start_step
                eta = (total_steps - step) * (time.perf_counter() - t_start) / max(1, done)
                log(f"step {step}/{total_steps} epoch {epoch} lr {sched.get_last_lr()[0]:.2e} "
                    f"loss {win['loss'] / win['n']:.3f} acc "
                    + " ".join(f"{a:.3f}" for a in last_acc)
                    + f" est.accept {expected_accept_length(last_acc):.2f} | "
                    f"{win['n'] / dt:.3f} steps/s {win['tokens'] / dt:.0f} tok/s "
                    + ("(cuda) " if device.type == "cuda" else
                       f"({governor.current if governor else torch.get_num_threads()} threads) ")
                    + f"eta {eta / 60:.0f} min")
                win = {"loss": 0.0, "n": 0, "correct": [0] * K, "count": [0] * K, "tokens": 0,
                       "t0": time.perf_counter(), "steps": 0}
            if step % cfg.save_every == 0 and step < total_steps:
                checkpoint(last_acc)
                if cfg.max_minutes and step - start_step > CALIBRATION_STEPS:
                    fit_time_budget(1.0)  # the measured rate now includes checkpoints
        if pos_in_epoch >= len(batches):
            epoch, pos_in_epoch = epoch + 1, 0
    bar.close()
    checkpoint(last_acc)
    log(f"done: {step} steps on {where}; head in {out}")
    return TrainResult(out, step, history)
